"""door.py: a TCP pipe on 127.0.0.1 to the decode vLLM that can stop taking connections
(test_kv_paths_e2e.py's pool `decode-door`; stack.sh starts it). SIGUSR1 closes it, SIGUSR2
opens it again.

Closed, its listening socket (backlog 0) has a connection of its own queued and never
accepted, so the accept queue is full and the kernel drops every new SYN: a connect to it
hangs until the door opens (the client sends its SYN again after 1 s, 3 s, ...). Closing also
cuts every connection piped so far, so no pooled keep-alive connection reaches the decode
either. Open, it pipes each connection to the decode, byte for byte.

Usage: python door.py LISTEN_PORT TARGET_PORT
"""

import signal
import socket
import sys
import threading

HOST = "127.0.0.1"


class Door:
    def __init__(self, port, target):
        self.port, self.target = port, target
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((HOST, port))
        self.sock.listen(0)
        self.sock.settimeout(0.2)
        self.is_open = threading.Event()
        self.is_open.set()
        self.lock = threading.Lock()  # the piped list
        self.accepting = threading.Lock()  # held across each accept: close() waits it out
        self.piped, self.filler = [], None

    def serve(self):
        while True:
            if not self.is_open.wait(0.2):
                continue
            with self.accepting:
                if not self.is_open.is_set():
                    continue
                try:
                    inbound, _ = self.sock.accept()
                except OSError:
                    continue
            if not self.is_open.is_set():
                inbound.close()
                continue
            try:
                outbound = socket.create_connection((HOST, self.target), timeout=5)
            except OSError:
                inbound.close()
                continue
            outbound.settimeout(None)
            inbound.settimeout(None)
            with self.lock:
                self.piped += [inbound, outbound]
            for a, b in ((inbound, outbound), (outbound, inbound)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()

    def close(self):
        self.is_open.clear()
        with self.accepting:  # no accept is running, and none starts before it opens again
            pass
        with self.lock:
            for s in self.piped:
                shut(s)
            self.piped = []
        if self.filler is None:
            self.filler = socket.socket()
            self.filler.setblocking(False)
            self.filler.connect_ex((HOST, self.port))  # queued, never accepted: the queue is full

    def open(self):
        if self.filler is not None:
            self.filler.close()
            self.filler = None
        self.is_open.set()


def shut(s):
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def pipe(src, dst):
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        shut(src)
        shut(dst)


if __name__ == "__main__":
    door = Door(int(sys.argv[1]), int(sys.argv[2]))
    # Handlers run on the main thread, which may be inside serve()'s accept: the work goes to a
    # thread of its own (close() waits for that accept to end).
    signal.signal(signal.SIGUSR1, lambda *_: threading.Thread(target=door.close).start())
    signal.signal(signal.SIGUSR2, lambda *_: threading.Thread(target=door.open).start())
    print(f"door on {HOST}:{door.port} -> {door.target}", flush=True)
    door.serve()
