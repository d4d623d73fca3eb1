//! The launcher's side of the control connections: accept ranks, check their `Hello`,
//! and turn everything they send (or their connection closing) into [`ConnEvent`]s for
//! the supervisor. Sending `Start` is the supervisor's job, through the write halves
//! handed over with each `Hello`.

use crate::protocol::{self, Msg, ProtocolError, MAGIC, PROTOCOL_VERSION};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// How long a new connection may take to send its `Hello`.
const HELLO_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Something that happened on a control connection.
#[derive(Debug)]
pub enum ConnEvent {
    /// A rank said a valid hello; `writer` is how to talk back to it.
    Hello { rank: usize, data_addr: String, writer: OwnedWriteHalf },
    /// A message from a rank that already said hello.
    Msg { rank: usize, msg: Msg },
    /// A rank's connection ended: `None` = closed cleanly, `Some(why)` = broken.
    Closed { rank: usize, error: Option<String> },
    /// A connection that is not a usable rank. `fatal` when it is one of ours but cannot
    /// take part (wrong protocol version, rank out of range).
    Rejected { peer: SocketAddr, reason: String, fatal: bool },
}

/// Accept connections forever (abort the task to stop), one reader task per connection.
pub async fn accept_loop(listener: TcpListener, world: usize, events: mpsc::UnboundedSender<ConnEvent>) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                tokio::spawn(serve(stream, peer, world, events.clone()));
            }
            Err(e) => {
                // Out of file descriptors and the like: back off, keep serving.
                eprintln!("launcher: accepting a rank connection failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn serve(stream: TcpStream, peer: SocketAddr, world: usize, events: mpsc::UnboundedSender<ConnEvent>) {
    let (mut reader, writer) = stream.into_split();
    let reject = |reason: String, fatal: bool| ConnEvent::Rejected { peer, reason, fatal };
    let first = match tokio::time::timeout(HELLO_READ_TIMEOUT, protocol::recv_async(&mut reader)).await {
        Ok(Ok(msg)) => msg,
        Ok(Err(e)) => {
            let _ = events.send(reject(format!("no valid hello: {e}"), false));
            return;
        }
        Err(_) => {
            let _ = events.send(reject(format!("sent no hello within {HELLO_READ_TIMEOUT:?}"), false));
            return;
        }
    };
    let (rank, data_addr) = match first {
        Msg::Hello { magic, version, rank, data_addr } => {
            if magic != MAGIC {
                let _ = events.send(reject("wrong magic in hello: not a shardtrain rank".into(), false));
                return;
            }
            if version != PROTOCOL_VERSION {
                let _ = events.send(reject(
                    format!(
                        "rank {rank} speaks control protocol v{version} but this launcher speaks v{PROTOCOL_VERSION}: \
                         run the same launcher build on every node"
                    ),
                    true,
                ));
                return;
            }
            if rank as usize >= world {
                let _ = events.send(reject(
                    format!(
                        "a worker claims rank {rank} but the job has {world} ranks: give every node the same \
                         --cpus/--nnodes and a distinct --node-rank"
                    ),
                    true,
                ));
                return;
            }
            (rank as usize, data_addr)
        }
        other => {
            let _ = events.send(reject(format!("expected a hello, got {other:?}"), false));
            return;
        }
    };
    if events.send(ConnEvent::Hello { rank, data_addr, writer }).is_err() {
        return;
    }
    loop {
        match protocol::recv_async(&mut reader).await {
            Ok(msg) => {
                if events.send(ConnEvent::Msg { rank, msg }).is_err() {
                    return;
                }
            }
            Err(ProtocolError::Closed) => {
                let _ = events.send(ConnEvent::Closed { rank, error: None });
                return;
            }
            Err(e) => {
                let _ = events.send(ConnEvent::Closed { rank, error: Some(e.to_string()) });
                return;
            }
        }
    }
}
