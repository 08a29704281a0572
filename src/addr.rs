//! Engine addresses as written in config and headers: `host:port` (and its host), and pool entries that
//! name data-parallel ranks of one server (`host:port#R`, `host:port#FIRST-LAST`).

/// True for `host:port` with a non-empty host (name or IP, IPv6 in brackets) and a port.
pub fn is_host_port(text: &str) -> bool {
    let Some((host, port)) = text.rsplit_once(':') else {
        return false;
    };
    let host_ok = if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        inner.parse::<std::net::Ipv6Addr>().is_ok()
    } else {
        !host.is_empty() && host.len() <= 253 && host.chars().all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-')
    };
    host_ok && port.parse::<u16>().is_ok_and(|p| p > 0)
}

/// The host of `host:port` (without IPv6 brackets).
pub fn host_of(host_port: &str) -> &str {
    let host = host_port.rsplit_once(':').map_or(host_port, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// Most members one pool entry's rank range (`host:port#0-255`) expands to.
pub const MAX_RANKS_PER_ENTRY: u32 = 256;

/// A pool entry: `host:port`, or `host:port#R` / `host:port#A-B` for the data-parallel
/// rank(s) of one vLLM server that legs to it name in `X-data-parallel-rank` (vLLM's
/// internal or hybrid load balancing). Returns the address and its ranks (`[None]` without a
/// suffix); `None` when the entry is malformed or the range is empty, reversed or wider
/// than [`MAX_RANKS_PER_ENTRY`].
pub fn endpoint_ranks(entry: &str) -> Option<(&str, Vec<Option<u32>>)> {
    let Some((addr, ranks)) = entry.split_once('#') else {
        return is_host_port(entry).then(|| (entry, vec![None]));
    };
    let rank = |t: &str| t.parse::<u32>().ok().filter(|_| t.bytes().all(|b| b.is_ascii_digit()));
    let (first, last) = match ranks.split_once('-') {
        Some((a, b)) => (rank(a)?, rank(b)?),
        None => (rank(ranks)?, rank(ranks)?),
    };
    let ok = is_host_port(addr) && first <= last && last - first < MAX_RANKS_PER_ENTRY;
    ok.then(|| (addr, (first..=last).map(Some).collect()))
}
