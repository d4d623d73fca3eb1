//! The control protocol between the launcher and its ranks (the rendezvous, progress
//! reports and stop orders; tensors never travel here, they go over the ranks' own
//! data-plane group).
//!
//! Frames are a little-endian `u32` byte length followed by one bincode-encoded [`Msg`].
//! A connection's first frame (its `Hello`) may be at most [`MAX_HELLO_FRAME`] bytes, later
//! ones [`MAX_FRAME`]: a stranger cannot make the launcher allocate more than that.
//! The conversation, per rank:
//! 1. rank → launcher `Hello { magic, version, token, rank, data_addr, fingerprint }`
//!    once its data-plane listener is bound. `token` is the job's secret (a connection
//!    without it is logged and ignored); `fingerprint` is the resolved config the rank's
//!    node runs, compared with node 0's (a difference refuses the job, naming the keys);
//! 2. launcher → rank `Start { world, peers, nccl_id }` once every rank said hello
//!    (`peers[r]` is rank r's data-plane address; `nccl_id` is for GPU ranks);
//! 3. rank → launcher `Heartbeat { rank, progress }` about every second (where the rank
//!    is: step, micro-step, collectives, phase, its flight recorder's newest record; the
//!    hang watchdog reads them) and
//!    `Step { rank, metrics }` after every optimizer step; `LogLost { rank, lines, error }`
//!    when lines of its log could not be written (a full disk), with the count so far;
//!    `Doctor { rank, report }` once, in a `launcher doctor` run, instead of steps;
//! 4. rank → launcher `Done { rank }`, or `Failed { rank, message, peer, setup }` and exit
//!    code 1 (2 when `setup`: a data, checkpoint or config problem);
//! 5. launcher → rank `DumpFlight` when the job hangs or a rank failed: the rank answers
//!    `Flight { rank, records }`, its flight recorder's last collectives (and writes them to
//!    its log); a rank that fails sends its `Flight` before its `Failed`;
//! 6. launcher → rank `Stop { reason, kind }` at any time: the rank aborts its communicator
//!    and exits (code 3 for the watchdog, 2 when its config was refused). A hello that node 0
//!    refuses (the wrong job token, a rank outside the job) is answered with `Stop { Refused }`
//!    saying why, before the connection closes.
//!
//! Before a node other than 0 starts its ranks, its launcher checks that node 0's rendezvous
//! answers: `Probe { magic, version, node, token }` as its connection's first frame, answered
//! by `Welcome`, or by `Stop { Refused }` with the reason (the wrong job token).
//!
//! The launcher keeps each connection open until the rank exits; a rank that sees its
//! connection close exits at once (so ranks never outlive their launcher).
//!
//! Also the lines of a rank's log that a launcher reads back ([`step_line`],
//! [`lost_peer_line`]): a node other than 0 learns a failed rank's last step and the peer it
//! lost from its log, not from the control connection.

use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use trainer::StepMetrics;

/// First bytes of every `Hello`: tells a shardtrain rank from a stray connection.
pub const MAGIC: [u8; 8] = *b"SHRDTRN\0";
/// Bumped whenever [`Msg`] changes; launcher and ranks must agree.
pub const PROTOCOL_VERSION: u32 = 5;
/// The first frame of a connection (its hello) may be at most this long.
pub const MAX_HELLO_FRAME: usize = 64 << 10;
/// Any later frame may be at most this long (a corrupt length, or not our protocol).
pub const MAX_FRAME: usize = 4 << 20;

/// Every message of the control protocol.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Msg {
    /// A rank is up and its data-plane listener is bound at `data_addr`. `token` is the
    /// job's secret, `fingerprint` what its node runs (the resolved config, launch and
    /// launcher version as sorted `key = value` pairs, see `fingerprint.rs`).
    Hello {
        magic: [u8; 8],
        version: u32,
        token: String,
        rank: u32,
        data_addr: String,
        fingerprint: Vec<(String, String)>,
    },
    /// Every rank is up: connect the group. `peers[r]` is rank r's data-plane address.
    Start { world: u32, peers: Vec<String>, nccl_id: Option<Vec<u8>> },
    /// A finished optimizer step as seen by `rank`.
    Step { rank: u32, metrics: Box<StepMetrics> },
    /// Where `rank` is now (sent about every second while it runs).
    Heartbeat { rank: u32, progress: RankProgress },
    /// `rank` finished training.
    Done { rank: u32 },
    /// `rank` stopped with an error. `peer` is set when the cause was another rank
    /// becoming unreachable (so the launcher blames that rank, not this one); `setup` when
    /// it is a data, checkpoint or config problem (the job's exit code is then 2).
    Failed { rank: u32, message: String, peer: Option<u32>, setup: bool },
    /// The launcher stops the rank: abort the communicator and exit.
    Stop { reason: String, kind: StopKind },
    /// The launcher of node `node` asks whether node 0's rendezvous takes this job token.
    Probe { magic: [u8; 8], version: u32, node: u32, token: String },
    /// Node 0's answer to a `Probe` with the job's token (a wrong one gets `Stop { Refused }`).
    Welcome,
    /// `rank` could not write `lines` lines of its log so far (its log is on a full disk, or
    /// unwritable); `error` is the first failure. Training goes on; the summary reports them.
    LogLost { rank: u32, lines: u64, error: String },
    /// The launcher asks for the rank's flight recorder (the job hangs, or a rank failed).
    DumpFlight,
    /// `rank`'s flight recorder: its last collectives, oldest first.
    Flight { rank: u32, records: Vec<CollectiveRecord> },
    /// `launcher doctor`: what `rank` measured (sent before its `Done`).
    Doctor { rank: u32, report: Box<crate::doctor::report::RankReport> },
}

/// One collective of a rank's flight recorder (`collectives::flight::Record` on the wire).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectiveRecord {
    /// The rank's collective count at it: equal numbers should be the same collective everywhere.
    pub seq: u64,
    /// `all_gather`, `reduce_scatter`, `all_reduce`, `broadcast` or `barrier`.
    pub op: String,
    pub bytes: u64,
    pub dtype: String,
    pub unit: Option<u32>,
    /// Optimizer steps done when it began (it belongs to step `steps_done + 1`), the
    /// micro-step and the phase.
    pub steps_done: u64,
    pub micro: u32,
    pub phase: String,
    /// Microseconds since the Unix epoch.
    pub start_us: u64,
    pub end_us: Option<u64>,
    /// `running`, `done`, `queued` (a started collective) or `failed`.
    pub state: String,
}

impl From<collectives::flight::Record> for CollectiveRecord {
    fn from(r: collectives::flight::Record) -> Self {
        CollectiveRecord {
            seq: r.seq,
            op: r.op.name().to_string(),
            bytes: r.bytes,
            dtype: r.dtype.to_string(),
            unit: r.unit,
            steps_done: r.steps_done,
            micro: r.micro,
            phase: r.phase.name().to_string(),
            start_us: r.start_us,
            end_us: r.end_us,
            state: r.state.name().to_string(),
        }
    }
}

/// Why the launcher stops a rank, and so the rank's exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum StopKind {
    /// The hang watchdog saw no progress (exit code 3).
    Hung,
    /// The rendezvous refused the rank's node: another config or build (exit code 2).
    Refused,
}

impl StopKind {
    /// The exit code of a rank (and of a launcher) stopped for this reason.
    pub fn exit_code(self) -> u8 {
        match self {
            StopKind::Hung => 3,
            StopKind::Refused => 2,
        }
    }
}

/// A rank's position for the watchdog (`collectives::progress::Snapshot` on the wire).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankProgress {
    /// Bumped by every update: unchanged means the rank did nothing since the last report.
    pub events: u64,
    pub steps_done: u64,
    pub micro: u32,
    /// Collectives entered so far (the same sequence on every rank).
    pub collectives: u64,
    /// The last collective entered (`all_gather`, ..., `connect`).
    pub last_op: Option<String>,
    /// Blocked inside `last_op` now.
    pub inside: bool,
    /// `start-up`, `training`, `evaluation`, `checkpoint save` or `done`.
    pub phase: String,
    /// The flight recorder's newest record (what the launcher knows of a rank that cannot
    /// answer a dump).
    pub last: Option<CollectiveRecord>,
}

impl RankProgress {
    /// Where the rank `p` tracks is now.
    pub fn of(p: &collectives::progress::Progress) -> RankProgress {
        let s = p.snapshot();
        RankProgress {
            events: s.events,
            steps_done: s.steps_done,
            micro: s.micro,
            collectives: s.collectives,
            last_op: s.last_op.map(|o| o.name().to_string()),
            inside: s.inside,
            phase: s.phase.name().to_string(),
            last: p.flight().last().map(CollectiveRecord::from),
        }
    }
}

impl Msg {
    /// A `Hello` of this protocol version.
    pub fn hello(token: String, rank: u32, data_addr: String, fingerprint: Vec<(String, String)>) -> Msg {
        Msg::Hello { magic: MAGIC, version: PROTOCOL_VERSION, token, rank, data_addr, fingerprint }
    }
}

/// What a rank's own launcher tells it on its stdin (one JSON line) before it starts: the
/// job token, the node's fingerprint, how often to send heartbeats. The pipe then stays
/// open; its end tells the rank that its launcher is gone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Bootstrap {
    pub token: String,
    pub fingerprint: Vec<(String, String)>,
    pub heartbeat_ms: u64,
}

/// The magic and protocol version at the start of a hello body, read even when the rest
/// does not decode (a launcher of another version sent it).
pub fn peek_hello_version(body: &[u8]) -> Option<([u8; 8], u32)> {
    let ((variant, magic, version), _): ((u32, [u8; 8], u32), usize) =
        bincode::serde::decode_from_slice(body, bincode::config::standard()).ok()?;
    (variant == 0).then_some((magic, version))
}

/// Control-protocol failures.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("connection closed")]
    Closed,
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    #[error("frame of {0} bytes exceeds the {1}-byte limit: not a shardtrain control connection?")]
    TooLarge(usize, usize),
    #[error("cannot decode a control message ({0}): are the launcher and the worker the same build?")]
    Decode(String),
    #[error("cannot encode a control message: {0}")]
    Encode(String),
}

/// Encode one message as a length-prefixed frame.
pub fn encode(msg: &Msg) -> Result<Vec<u8>, ProtocolError> {
    let body = bincode::serde::encode_to_vec(msg, bincode::config::standard())
        .map_err(|e| ProtocolError::Encode(e.to_string()))?;
    if body.len() > MAX_FRAME {
        return Err(ProtocolError::TooLarge(body.len(), MAX_FRAME));
    }
    let len = u32::try_from(body.len()).map_err(|_| ProtocolError::TooLarge(body.len(), MAX_FRAME))?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

pub fn decode(body: &[u8]) -> Result<Msg, ProtocolError> {
    let (msg, used) = bincode::serde::decode_from_slice(body, bincode::config::standard())
        .map_err(|e| ProtocolError::Decode(e.to_string()))?;
    if used != body.len() {
        return Err(ProtocolError::Decode(format!("{} trailing bytes", body.len() - used)));
    }
    Ok(msg)
}

fn frame_len(header: [u8; 4], max: usize) -> Result<usize, ProtocolError> {
    let len = u32::from_le_bytes(header) as usize;
    if len > max {
        return Err(ProtocolError::TooLarge(len, max));
    }
    Ok(len)
}

fn map_eof(e: std::io::Error) -> ProtocolError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        ProtocolError::Closed
    } else {
        ProtocolError::Io(e)
    }
}

/// Blocking send (the worker side).
pub fn send(w: &mut impl Write, msg: &Msg) -> Result<(), ProtocolError> {
    w.write_all(&encode(msg)?)?;
    w.flush()?;
    Ok(())
}

/// Blocking receive (the worker side). `Closed` on a clean end of stream.
pub fn recv(r: &mut impl Read) -> Result<Msg, ProtocolError> {
    let mut header = [0u8; 4];
    r.read_exact(&mut header).map_err(map_eof)?;
    let mut body = vec![0u8; frame_len(header, MAX_FRAME)?];
    r.read_exact(&mut body).map_err(map_eof)?;
    decode(&body)
}

/// Async send (the launcher side).
pub async fn send_async(w: &mut (impl AsyncWrite + Unpin), msg: &Msg) -> Result<(), ProtocolError> {
    w.write_all(&encode(msg)?).await?;
    w.flush().await?;
    Ok(())
}

/// Async receive (the launcher side). `Closed` on a clean end of stream.
pub async fn recv_async(r: &mut (impl AsyncRead + Unpin)) -> Result<Msg, ProtocolError> {
    decode(&recv_frame_async(r, MAX_FRAME).await?)
}

/// Async receive of one frame's body of at most `max` bytes, undecoded.
pub async fn recv_frame_async(r: &mut (impl AsyncRead + Unpin), max: usize) -> Result<Vec<u8>, ProtocolError> {
    let mut header = [0u8; 4];
    r.read_exact(&mut header).await.map_err(map_eof)?;
    let mut body = vec![0u8; frame_len(header, max)?];
    r.read_exact(&mut body).await.map_err(map_eof)?;
    Ok(body)
}

/// The rank's step report line in its log; [`parse_step_line`] reads it back (a launcher on
/// another node than 0 learns a failed rank's last step from it).
pub fn step_line(rank: usize, m: &trainer::StepMetrics, total: usize) -> String {
    format!(
        "rank {rank} step {}/{total} loss {:.6} lr {:.3e} grad_norm {:.4} time {:.3}s",
        m.step, m.loss, m.lr, m.grad_norm, m.step_time_s
    )
}

/// The log line saying this rank failed because it lost `peer` (see [`parse_lost_peer_line`]).
pub fn lost_peer_line(rank: usize, peer: u32) -> String {
    format!("rank {rank}: lost rank {peer}")
}

/// The peer of a [`lost_peer_line`] of `rank`, if `line` is one.
pub fn parse_lost_peer_line(rank: usize, line: &str) -> Option<u32> {
    line.strip_prefix(&format!("rank {rank}: lost rank "))?.trim().parse().ok()
}

/// The step of a [`step_line`] of `rank`, if `line` is one.
pub fn parse_step_line(rank: usize, line: &str) -> Option<u64> {
    let rest = line.strip_prefix(&format!("rank {rank} step "))?;
    rest.split_once('/')?.0.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_lines_read_back() {
        let m = trainer::StepMetrics {
            step: 7,
            loss: 1.5,
            lr: 1e-3,
            grad_norm: 0.3,
            tokens: 10,
            step_time_s: 0.1,
            val_loss: None,
            memory: Default::default(),
            device: None,
            host_optimizer: None,
            sources: Vec::new(),
            checkpoint: None,
        };
        let line = step_line(3, &m, 50);
        assert!(line.starts_with("rank 3 step 7/50 loss"), "{line}");
        assert_eq!(parse_step_line(3, &line), Some(7));
        assert_eq!(parse_step_line(13, &line), None);
        assert_eq!(parse_step_line(3, "rank 3: done"), None);
        assert_eq!(parse_lost_peer_line(3, &lost_peer_line(3, 2)), Some(2));
        assert_eq!(parse_lost_peer_line(13, &lost_peer_line(3, 2)), None);
        assert_eq!(parse_lost_peer_line(3, "rank 3: error: rank 2 is unreachable"), None);
    }

    #[test]
    fn frames_round_trip() {
        let msgs = [
            Msg::hello("t0k3n".into(), 3, "127.0.0.1:4000".into(), vec![("train.lr".into(), "0.001".into())]),
            Msg::Heartbeat { rank: 1, progress: RankProgress::of(&collectives::progress::Progress::new()) },
            Msg::DumpFlight,
            Msg::Flight { rank: 2, records: vec![] },
            Msg::Stop { reason: "hung".into(), kind: StopKind::Hung },
            Msg::Start { world: 2, peers: vec!["a:1".into(), "b:2".into()], nccl_id: Some(vec![7; 128]) },
            Msg::Done { rank: 1 },
            Msg::Failed { rank: 0, message: "boom".into(), peer: Some(1), setup: false },
            Msg::Probe { magic: MAGIC, version: PROTOCOL_VERSION, node: 1, token: "t0k3n".into() },
            Msg::Welcome,
        ];
        let mut wire = Vec::new();
        for m in &msgs {
            send(&mut wire, m).expect("send");
        }
        let mut r = &wire[..];
        for m in &msgs {
            assert_eq!(&recv(&mut r).expect("recv"), m);
        }
        assert!(matches!(recv(&mut r), Err(ProtocolError::Closed)));
    }

    #[test]
    fn garbage_is_refused() {
        let mut r: &[u8] = b"GET / HTTP/1.1\r\n\r\n";
        assert!(matches!(recv(&mut r), Err(ProtocolError::TooLarge(..))));
        let mut frame = 3u32.to_le_bytes().to_vec();
        frame.extend_from_slice(&[0xff, 0xff, 0xff]);
        assert!(matches!(recv(&mut &frame[..]), Err(ProtocolError::Decode(_))));
    }
}

#[cfg(test)]
mod bounds {
    use super::*;

    #[test]
    fn a_hello_is_bounded_and_its_version_readable_alone() {
        let hello = Msg::hello("secret".into(), 0, "a:1".into(), vec![]);
        let frame = encode(&hello).expect("encode");
        assert!(frame.len() < MAX_HELLO_FRAME);
        assert_eq!(peek_hello_version(&frame[4..]), Some((MAGIC, PROTOCOL_VERSION)));
        // A version-1 hello (magic, version 1, rank, address) still shows its version.
        let v1 = bincode::serde::encode_to_vec((0u32, MAGIC, 1u32, 3u32, "a:1"), bincode::config::standard())
            .expect("encode v1");
        assert_eq!(peek_hello_version(&v1), Some((MAGIC, 1)));
        assert!(decode(&v1).is_err());
        // A length prefix past the bound is refused before anything is allocated.
        let big = ((MAX_HELLO_FRAME + 1) as u32).to_le_bytes();
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        let got = rt.block_on(recv_frame_async(&mut &big[..], MAX_HELLO_FRAME));
        assert!(matches!(got, Err(ProtocolError::TooLarge(n, MAX_HELLO_FRAME)) if n == MAX_HELLO_FRAME + 1));
        let huge = Msg::Stop { reason: "x".repeat(MAX_FRAME + 1), kind: StopKind::Hung };
        assert!(matches!(encode(&huge), Err(ProtocolError::TooLarge(..))));
    }
}
