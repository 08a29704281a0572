"""A discrete-event model of benches/fleet.rs, to sweep endpoint-choice policies in seconds.

It models what the bench's fakes do, not tokenonce's code: 8 prefill engines, each a prefix
cache of 32-token blocks (least recently used evicted first, a request's tail before its head)
computing one prefill at a time, FIFO, in 36 ms + 0.11 ms per uncached token; a decode's first
token 64 ms; the bench's agentic trace (clients running sessions of turns over shared system
prompts with think time, the first session joined mid-way). A cache-aware pick sees each
engine's cache as it is at that instant (the KV events without lag) and tokenonce's in-flight
count per engine. Times are real-engine ms (no time scale, no CPU cost of tokenonce or fakes).

Run: python3 benches/fleet_model.py '{"clients": 256}' rr oracle ca ca:lw=0.25 work:lw=1
  rr / lif / oracle: round robin, least in flight, every turn of a session on its home
  ca[:pw=P][:lw=L]: tokenonce's score, max of P x held/blocks - L x in_flight (default 0.1)
  work[:lw=L]: the alternative measured against it, min of missing + queued blocks + L x in_flight
The first argument (JSON) overrides run()'s keyword defaults (the bench's flags).
"""
import heapq, random, sys
from collections import OrderedDict

def run(policy, clients=256, turns=10, sessions=2, max_tokens=37000, system_tokens=2000, systems=4,
        think=20000.0, cache_share=1.0, P=8, bs=32, deadline_ms=1e12, seed=1, **kw):
    rnd = random.Random(seed)
    cap = int(cache_share * clients * max_tokens / P / bs + 0.999)
    caches = [OrderedDict() for _ in range(P)]
    queue = [[] for _ in range(P)]   # FIFO of pending request ids
    busy = [False]*P
    inflight = [0]*P
    queued_blocks = [0]*P
    growth = (max_tokens - system_tokens) // turns
    user = growth*7//10; assistant = growth - user
    ev = []  # (time, seq, kind, data)
    seq = [0]
    def push(t, kind, data):
        seq[0] += 1; heapq.heappush(ev, (t, seq[0], kind, data))
    # client state
    st = {}
    for c in range(clients):
        st[c] = dict(s=0, turn=c % turns, session=c*sessions)
        push(think*rnd.random(), 'send', c)
    rr = [0]
    ttft = []; prompt_tok = [0]; cached_tok = [0]
    reqs = {}
    def chain(session, ntok):
        sysb = system_tokens // bs
        n = ntok // bs
        sysid = session % systems
        return [('s', sysid, i) if i < sysb else ('u', session, i) for i in range(n)]
    def held(e, ch):
        c = caches[e]; k = 0
        for h in ch:
            if h in c: k += 1
            else: break
        return k
    lw = kw.get('lw', 0.1); pw = kw.get('pw', 1.0)
    def pick(c, ch):
        s = st[c]; n = len(ch)
        turn = rr[0]; rr[0] += 1
        order = [(turn + i) % P for i in range(P)]
        if policy == 'rr': return order[0], 0
        if policy == 'oracle': return s['session'] % P, 0
        if policy == 'lif': return min(order, key=lambda e: inflight[e]), 0
        hs = {e: held(e, ch) for e in order}
        if policy == 'ca':   # current: score = pw*held/blocks - lw*inflight, max
            best = max(order, key=lambda e: (pw*hs[e]/max(n,1) - lw*inflight[e], -order.index(e)))
            return best, n - hs[best]
        if policy == 'work':  # cost = pw*(missing + queued) + lw*inflight, min
            best = min(order, key=lambda e: (pw*(n - hs[e] + queued_blocks[e]) + lw*inflight[e], order.index(e)))
            return best, n - hs[best]
        raise SystemExit(policy)
    def start(e, t):
        if busy[e] or not queue[e]: return
        r = queue[e].pop(0); busy[e] = True
        R = reqs[r]; ch = R['chain']
        h = held(e, ch)
        unc = R['ntok'] - h*bs
        prompt_tok[0] += R['ntok']; cached_tok[0] += h*bs
        push(t + 36.0 + 0.11*unc, 'done', (e, r))
    while ev:
        t, _, kind, data = heapq.heappop(ev)
        if t > deadline_ms: break
        if kind == 'send':
            c = data; s = st[c]
            if s['s'] >= sessions: continue
            ntok = system_tokens + s['turn']*growth + user
            ch = chain(s['session'], ntok)
            e, missing = pick(c, ch)
            rid = len(reqs)
            reqs[rid] = dict(c=c, t0=t, chain=ch, ntok=ntok, missing=missing)
            inflight[e] += 1; queued_blocks[e] += missing
            queue[e].append(rid); start(e, t)
        elif kind == 'done':
            e, r = data; R = reqs[r]
            c = caches[e]
            for h in reversed(R['chain']):
                c[h] = 1; c.move_to_end(h)
            while len(c) > cap: c.popitem(last=False)
            busy[e] = False; inflight[e] -= 1; queued_blocks[e] -= R['missing']
            ttft.append(t + 64.0 - R['t0'])
            start(e, t)
            cl = R['c']; s = st[cl]
            s['turn'] += 1
            if s['turn'] >= turns:
                s['s'] += 1; s['turn'] = 0; s['session'] = cl*sessions + s['s']
            push(t + 64.0 + think*(0.5 + rnd.random()), 'send', cl)
    ttft.sort()
    q = lambda p: ttft[int(round((len(ttft)-1)*p))]
    return dict(n=len(ttft), p50=q(.5), p99=q(.99), hit=cached_tok[0]/prompt_tok[0])

if __name__ == '__main__':
    import json
    args = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    for spec in sys.argv[2:]:
        pol, *rest = spec.split(':')
        kw = dict(args)
        for r in rest:
            k, v = r.split('='); kw[k] = float(v)
        out = run(pol, **kw)
        print(f"{spec:20s} n={out['n']:5d} p50={out['p50']:8.0f} p99={out['p99']:8.0f} hit={out['hit']*100:5.1f}%", flush=True)
