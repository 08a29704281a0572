//! Raw sockets on loopback: an address that refuses connections, a raw engine's accept loop,
//! and a client that can stop reading while tokenonce still writes.

use std::net::SocketAddr;
use std::time::Duration;

/// A loopback address that refuses connections while this value lives: the socket is bound,
/// so nothing else can take the port, but never listens, so every connect is answered with
/// a reset.
pub struct RefusedAddr {
    _socket: tokio::net::TcpSocket,
    /// The address.
    pub addr: SocketAddr,
}

impl RefusedAddr {
    /// Binds a fresh `127.0.0.1:0`.
    pub fn new() -> Self {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = socket.local_addr().unwrap();
        Self { _socket: socket, addr }
    }
}

impl Default for RefusedAddr {
    fn default() -> Self {
        Self::new()
    }
}

/// A raw engine on loopback: accepts up to `connections` connections and hands each to
/// `serve`. Returns its `host:port`.
pub async fn raw_engine<F, Fut>(connections: usize, serve: F) -> String
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        for _ in 0..connections {
            let Ok((sock, _)) = listener.accept().await else { return };
            tokio::spawn(serve(sock));
        }
    });
    addr
}

/// A client speaking HTTP/1.1 by hand on a socket with a 4 KB receive buffer, so it can stop
/// reading while tokenonce still has much to write.
pub struct SlowClient(tokio::net::TcpStream);

impl SlowClient {
    /// Connects to `url` (`http://host:port`) and POSTs `body` as JSON to `path`.
    pub async fn post(url: &str, path: &str, body: &serde_json::Value) -> Self {
        use tokio::io::AsyncWriteExt;
        let body = serde_json::to_vec(body).unwrap();
        let addr: SocketAddr = url.trim_start_matches("http://").parse().unwrap();
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut client = socket.connect(addr).await.unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        client.write_all(head.as_bytes()).await.unwrap();
        client.write_all(&body).await.unwrap();
        Self(client)
    }

    /// The first bytes of the answer (at most 64), read within `within`.
    pub async fn first_bytes(&mut self, within: Duration) -> Vec<u8> {
        use tokio::io::AsyncReadExt;
        let mut first = [0u8; 64];
        let n = tokio::time::timeout(within, self.0.read(&mut first)).await.unwrap().unwrap();
        first[..n].to_vec()
    }

    /// Reads on, discarding, until the connection ends (true: tokenonce cut or closed it) or
    /// `within` passes (false).
    pub async fn drained(&mut self, within: Duration) -> bool {
        use tokio::io::AsyncReadExt;
        let mut sink = vec![0u8; 1 << 16];
        tokio::time::timeout(within, async {
            loop {
                match self.0.read(&mut sink).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await
        .is_ok()
    }
}
