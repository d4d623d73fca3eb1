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
//! right token that cannot take part (a rank number outside the job) is fatal. A shardtrain
//! rank that is turned away is told why (`Stop { Refused }`: "the wrong job token", never
//! the token itself), so its node can say it instead of "connection closed".
//!
//! The other side, [`reach_master`]: a node other than 0 checks that node 0's rendezvous
//! answers and takes its token before starting any rank (`Probe`), saying what it waits
//! for, and where, while node 0 is not up yet.

use crate::job::token::JobToken;
use crate::run::protocol::{self, Msg, ProtocolError, StopKind, MAGIC, MAX_HELLO_FRAME, PROTOCOL_VERSION};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// How long a new connection may take to send its `Hello`.
const HELLO_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a refusal may take to send (a stranger that does not read is not waited for).
const REFUSAL_SEND_TIMEOUT: Duration = Duration::from_secs(1);

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
    /// The launcher of node `node` reached the rendezvous with the job's token.
    NodeUp { node: u32, peer: SocketAddr },
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
    let (mut reader, mut writer) = stream.into_split();
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
    let token_env = crate::job::token::TOKEN_ENV;
    let (rank, data_addr, fingerprint) = match first {
        Msg::Hello { magic, version, token: offered, rank, data_addr, fingerprint } => {
            if magic != MAGIC {
                let _ = events.send(reject("wrong magic in hello: not a shardtrain rank".into(), false));
                return;
            }
            if !token.matches(&offered) {
                let told = format!(
                    "node 0 refused rank {rank}: its job token is not this job's (a rank of another job, or a node \
                     started without this job's token): give every node the same {token_env} (or --job-token) as \
                     node 0"
                );
                refuse(&mut writer, told).await;
                let _ = events.send(reject(
                    format!(
                        "a rank {rank} with the wrong job token (a rank of another job, or a node started without \
                         this job's token: give every node the same {token_env} or --job-token); told it so"
                    ),
                    false,
                ));
                return;
            }
            if version != PROTOCOL_VERSION {
                let reason = format!(
                    "rank {rank} speaks control protocol v{version} but this launcher speaks v{PROTOCOL_VERSION}: \
                     run the same launcher build on every node"
                );
                refuse(&mut writer, format!("node 0 refused {reason}")).await;
                let _ = events.send(reject(reason, true));
                return;
            }
            if rank as usize >= world {
                let reason = format!(
                    "a worker claims rank {rank} but the job has {world} ranks: give every node the same \
                     --cpus/--nnodes and a distinct --node-rank"
                );
                refuse(&mut writer, format!("node 0 refused this rank: {reason}")).await;
                let _ = events.send(reject(reason, true));
                return;
            }
            (rank as usize, data_addr, fingerprint)
        }
        Msg::Probe { magic, version, node, token: offered } if magic == MAGIC && version == PROTOCOL_VERSION => {
            if token.matches(&offered) {
                let _ =
                    tokio::time::timeout(REFUSAL_SEND_TIMEOUT, protocol::send_async(&mut writer, &Msg::Welcome)).await;
                let _ = events.send(ConnEvent::NodeUp { node, peer });
            } else {
                let told = format!(
                    "node 0 refused node {node}: its job token is not this job's: give every node the same \
                     {token_env} (or --job-token) as node 0 (node 0 prints the token it made at start-up)"
                );
                refuse(&mut writer, told).await;
                let _ =
                    events.send(reject(format!("node {node}'s launcher with the wrong job token; told it so"), false));
            }
            return;
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

/// Tell a shardtrain connection why node 0 turns it away (bounded: a stranger that does
/// not read is not waited for).
async fn refuse(writer: &mut OwnedWriteHalf, reason: String) {
    let stop = Msg::Stop { reason, kind: StopKind::Refused };
    let _ = tokio::time::timeout(REFUSAL_SEND_TIMEOUT, protocol::send_async(writer, &stop)).await;
}

/// Why a node other than 0 could not join node 0's rendezvous.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error(
        "node 0's rendezvous at {addr} did not answer within {}s (last: {last}): start node 0 with \
         --master-addr {addr}, check that this node reaches that address and port (firewall), or fix \
         --master-addr here",
        waited.as_secs()
    )]
    Unreachable { addr: SocketAddr, waited: Duration, last: String },
    #[error("{0}")]
    Refused(String),
    #[error(
        "node 0's rendezvous at {addr} did not answer this node's launcher ({why}): is node 0 running the same \
         launcher build, and is {addr} its --master-addr?"
    )]
    NoAnswer { addr: SocketAddr, why: String },
}

/// Wait (at most `patience`) until node 0's rendezvous at `addr` answers, and check that it
/// takes this job's token; `say` is called with what this node waits for, where and for how
/// long, at once when node 0 is not up and then every `every`.
pub async fn reach_master(
    addr: SocketAddr,
    node: usize,
    token: &JobToken,
    patience: Duration,
    every: Duration,
    say: impl Fn(&str),
) -> Result<(), JoinError> {
    let start = Instant::now();
    let mut next_say = start;
    loop {
        let attempt = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr)).await;
        let why = match attempt {
            Ok(Ok(stream)) => return probe(stream, addr, node, token).await,
            Ok(Err(e)) => e.to_string(),
            Err(_) => "no answer within 5 s".to_string(),
        };
        let waited = start.elapsed();
        if waited >= patience {
            return Err(JoinError::Unreachable { addr, waited, last: why });
        }
        if Instant::now() >= next_say {
            say(&format!(
                "node {node}: waiting for node 0's rendezvous at {addr} ({why}): {}s of {}s",
                waited.as_secs(),
                patience.as_secs()
            ));
            next_say = Instant::now() + every;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Ask node 0 whether it takes this token: `Welcome`, or the reason it refuses.
async fn probe(mut stream: TcpStream, addr: SocketAddr, node: usize, token: &JobToken) -> Result<(), JoinError> {
    let probe =
        Msg::Probe { magic: MAGIC, version: PROTOCOL_VERSION, node: node as u32, token: token.as_str().to_string() };
    let no_answer = |why: String| JoinError::NoAnswer { addr, why };
    protocol::send_async(&mut stream, &probe).await.map_err(|e| no_answer(e.to_string()))?;
    let reply = tokio::time::timeout(HELLO_READ_TIMEOUT, protocol::recv_frame_async(&mut stream, MAX_HELLO_FRAME))
        .await
        .map_err(|_| no_answer(format!("no reply within {HELLO_READ_TIMEOUT:?}")))?
        .map_err(|e| no_answer(e.to_string()))?;
    match protocol::decode(&reply) {
        Ok(Msg::Welcome) => Ok(()),
        Ok(Msg::Stop { reason, .. }) => Err(JoinError::Refused(reason)),
        Ok(other) => Err(no_answer(format!("it answered {other:?}"))),
        Err(e) => Err(no_answer(e.to_string())),
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
            let token = crate::job::token::resolve(Some("the-right-token"), None, None, 0).expect("token");
            let (tx, mut rx) = mpsc::unbounded_channel();
            let acceptor = tokio::spawn(accept_loop(listener, 2, token, tx));
            let hello = |token: &str, rank: u32| Msg::hello(token.into(), rank, "127.0.0.1:1".into(), vec![]);
            let send = |bytes: Vec<u8>| async move {
                let mut s = TcpStream::connect(addr).await.expect("connect");
                s.write_all(&bytes).await.expect("write");
                s
            };

            // A stranger with the wrong token, then one announcing a 1 GiB frame: both ignored.
            // The first is a shardtrain rank, so it is told why (without the job's token).
            let mut a = send(protocol::encode(&hello("a-wrong-token", 1)).expect("encode")).await;
            match rx.recv().await {
                Some(ConnEvent::Rejected { reason, fatal: false, .. }) => {
                    assert!(reason.contains("wrong job token"), "{reason}")
                }
                other => panic!("expected a non-fatal rejection, got {other:?}"),
            }
            match protocol::recv_async(&mut a).await {
                Ok(Msg::Stop { reason, kind: StopKind::Refused }) => {
                    assert!(reason.contains("job token is not this job's") && reason.contains("SHARDTRAIN_JOB_TOKEN"));
                    assert!(!reason.contains("the-right-token"), "the token never travels back: {reason}");
                }
                other => panic!("expected the refusal's reason, got {other:?}"),
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

    #[test]
    fn a_node_waits_for_node_0_saying_where_and_learns_why_it_is_refused() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async {
            // Nothing listens yet: the node says what it waits for, then gives up.
            let addr = {
                let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
                l.local_addr().expect("addr")
            };
            let token = crate::job::token::resolve(Some("the-right-token"), None, None, 1).expect("token");
            let said = std::cell::RefCell::new(Vec::<String>::new());
            let note = |m: &str| said.borrow_mut().push(m.to_string());
            let patience = Duration::from_millis(600);
            let e = reach_master(addr, 1, &token, patience, Duration::from_millis(200), note).await.unwrap_err();
            assert!(matches!(e, JoinError::Unreachable { .. }), "{e}");
            assert!(e.to_string().contains(&addr.to_string()) && e.to_string().contains("--master-addr"), "{e}");
            let said = said.into_inner();
            assert!(said.len() >= 2, "said as it waited: {said:?}");
            assert!(said[0].contains(&format!("waiting for node 0's rendezvous at {addr}")), "{said:?}");

            // Node 0 up: the right token is welcome, a wrong one is refused with the reason.
            let listener = TcpListener::bind(addr).await.expect("bind");
            let (tx, mut rx) = mpsc::unbounded_channel();
            let acceptor = tokio::spawn(accept_loop(listener, 4, token.clone(), tx));
            let quiet = |_: &str| {};
            let second = Duration::from_secs(1);
            reach_master(addr, 1, &token, second, second, quiet).await.expect("welcome");
            assert!(matches!(rx.recv().await, Some(ConnEvent::NodeUp { node: 1, .. })));
            let wrong = crate::job::token::resolve(Some("a-wrong-token"), None, None, 1).expect("token");
            match reach_master(addr, 1, &wrong, second, second, quiet).await {
                Err(JoinError::Refused(why)) => {
                    assert!(why.contains("node 0 refused node 1") && why.contains("job token"))
                }
                other => panic!("expected a refusal, got {other:?}"),
            }
            acceptor.abort();
        });
    }
}
