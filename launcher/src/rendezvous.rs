//! The launcher's side of the control connections: accept ranks, check their `Hello`,
//! and turn everything they send (or their connection closing) into [`ConnEvent`]s for
//! the supervisor. Sending `Start` is the supervisor's job, through the write halves
//! handed over with each `Hello`.
//!
//! Only the job's ranks get in: the first frame of a connection is read with a small size
//! bound ([`protocol::MAX_HELLO_FRAME`]) and must be a hello with the job token. Anything
//! else (a scanner, a rank of another job, a node started without the token, another
//! protocol version) is reported as a non-fatal [`ConnEvent::Rejected`], which the
//! supervisor logs and ignores: no stranger can stop or join the job. A hello with the
//! right token that cannot take part (a rank number outside the job) is fatal.

use crate::protocol::{self, Msg, ProtocolError, MAGIC, MAX_HELLO_FRAME, PROTOCOL_VERSION};
use crate::token::JobToken;
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
    /// A rank said a valid hello; `writer` is how to talk back to it, `fingerprint` what its
    /// node runs.
    Hello {
        rank: usize,
        peer: SocketAddr,
        data_addr: String,
        fingerprint: Vec<(String, String)>,
        writer: OwnedWriteHalf,
    },
    /// A message from a rank that already said hello.
    Msg { rank: usize, msg: Msg },
    /// A rank's connection ended: `None` = closed cleanly, `Some(why)` = broken.
    Closed { rank: usize, error: Option<String> },
    /// A connection that is not a usable rank. `fatal` when it is one of ours (it knows the
    /// token) but cannot take part (rank out of range, another protocol version).
    Rejected { peer: SocketAddr, reason: String, fatal: bool },
}

/// Accept connections forever (abort the task to stop), one reader task per connection.
pub async fn accept_loop(
    listener: TcpListener,
    world: usize,
    token: JobToken,
    events: mpsc::UnboundedSender<ConnEvent>,
) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                tokio::spawn(serve(stream, peer, world, token.clone(), events.clone()));
            }
            Err(e) => {
                // Out of file descriptors and the like: back off, keep serving.
                crate::out::warn(&format!("launcher: accepting a rank connection failed: {e}"));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    world: usize,
    token: JobToken,
    events: mpsc::UnboundedSender<ConnEvent>,
) {
    let (mut reader, writer) = stream.into_split();
    let reject = |reason: String, fatal: bool| ConnEvent::Rejected { peer, reason, fatal };
    let body = match tokio::time::timeout(HELLO_READ_TIMEOUT, protocol::recv_frame_async(&mut reader, MAX_HELLO_FRAME))
        .await
    {
        Ok(Ok(body)) => body,
        Ok(Err(e)) => {
            let _ = events.send(reject(format!("no valid hello: {e}"), false));
            return;
        }
        Err(_) => {
            let _ = events.send(reject(format!("sent no hello within {HELLO_READ_TIMEOUT:?}"), false));
            return;
        }
    };
    let first = match protocol::decode(&body) {
        Ok(msg) => msg,
        Err(e) => {
            let reason = match protocol::peek_hello_version(&body) {
                Some((MAGIC, v)) if v != PROTOCOL_VERSION => format!(
                    "a shardtrain rank speaking control protocol v{v} (this launcher speaks v{PROTOCOL_VERSION}): \
                     run the same launcher build on every node"
                ),
                _ => format!("no valid hello: {e}"),
            };
            let _ = events.send(reject(reason, false));
            return;
        }
    };
    let (rank, data_addr, fingerprint) = match first {
        Msg::Hello { magic, version, token: offered, rank, data_addr, fingerprint } => {
            if magic != MAGIC {
                let _ = events.send(reject("wrong magic in hello: not a shardtrain rank".into(), false));
                return;
            }
            if !token.matches(&offered) {
                let _ = events.send(reject(
                    format!(
                        "a rank {rank} with the wrong job token (a rank of another job, or a node started without \
                         this job's token: give every node the same {} or --job-token)",
                        crate::token::TOKEN_ENV
                    ),
                    false,
                ));
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
            (rank as usize, data_addr, fingerprint)
        }
        other => {
            let _ = events.send(reject(format!("expected a hello, got {other:?}"), false));
            return;
        }
    };
    if events.send(ConnEvent::Hello { rank, peer, data_addr, fingerprint, writer }).is_err() {
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[test]
    fn only_hellos_with_the_job_token_get_in() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            let token = crate::token::resolve(Some("the-right-token"), None, 0).expect("token");
            let (tx, mut rx) = mpsc::unbounded_channel();
            let acceptor = tokio::spawn(accept_loop(listener, 2, token, tx));
            let hello = |token: &str, rank: u32| Msg::hello(token.into(), rank, "127.0.0.1:1".into(), vec![]);
            let send = |bytes: Vec<u8>| async move {
                let mut s = TcpStream::connect(addr).await.expect("connect");
                s.write_all(&bytes).await.expect("write");
                s
            };

            // A stranger with the wrong token, then one announcing a 1 GiB frame: both ignored.
            let _a = send(protocol::encode(&hello("a-wrong-token", 1)).expect("encode")).await;
            match rx.recv().await {
                Some(ConnEvent::Rejected { reason, fatal: false, .. }) => {
                    assert!(reason.contains("wrong job token"), "{reason}")
                }
                other => panic!("expected a non-fatal rejection, got {other:?}"),
            }
            let _b = send((1u32 << 30).to_le_bytes().to_vec()).await;
            match rx.recv().await {
                Some(ConnEvent::Rejected { reason, fatal: false, .. }) => {
                    assert!(reason.contains("exceeds"), "{reason}")
                }
                other => panic!("expected a non-fatal rejection, got {other:?}"),
            }
            // The job's own rank gets in.
            let _c = send(protocol::encode(&hello("the-right-token", 1)).expect("encode")).await;
            match rx.recv().await {
                Some(ConnEvent::Hello { rank: 1, .. }) => {}
                other => panic!("expected rank 1's hello, got {other:?}"),
            }
            acceptor.abort();
        });
    }
}
