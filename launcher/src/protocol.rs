//! The control protocol between the launcher and its ranks (the rendezvous and progress
//! reports; tensors never travel here, they go over the ranks' own data-plane group).
//!
//! Frames are a little-endian `u32` byte length followed by one bincode-encoded [`Msg`].
//! The conversation, per rank:
//! 1. rank → launcher `Hello { magic, version, rank, data_addr }` once its data-plane
//!    listener is bound;
//! 2. launcher → rank `Start { world, peers, nccl_id }` once every rank said hello
//!    (`peers[r]` is rank r's data-plane address; `nccl_id` is for GPU ranks);
//! 3. rank → launcher `Step { rank, metrics }` after every optimizer step;
//! 4. rank → launcher `Done { rank }`, or `Failed { rank, message, peer }` and exit code 1.
//!
//! The launcher keeps each connection open until the rank exits; a rank that sees its
//! connection close exits at once (so ranks never outlive their launcher).

use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use trainer::StepMetrics;

/// First bytes of every `Hello`: tells a shardtrain rank from a stray connection.
pub const MAGIC: [u8; 8] = *b"SHRDTRN\0";
/// Bumped whenever [`Msg`] changes; launcher and ranks must agree.
pub const PROTOCOL_VERSION: u32 = 1;
/// Frames larger than this are refused (a corrupt length, or not our protocol).
const MAX_FRAME: usize = 64 << 20;

/// Every message of the control protocol.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Msg {
    /// A rank is up and its data-plane listener is bound at `data_addr`.
    Hello { magic: [u8; 8], version: u32, rank: u32, data_addr: String },
    /// Every rank is up: connect the group. `peers[r]` is rank r's data-plane address.
    Start { world: u32, peers: Vec<String>, nccl_id: Option<Vec<u8>> },
    /// A finished optimizer step as seen by `rank`.
    Step { rank: u32, metrics: Box<StepMetrics> },
    /// `rank` finished training.
    Done { rank: u32 },
    /// `rank` stopped with an error. `peer` is set when the cause was another rank
    /// becoming unreachable (so the launcher blames that rank, not this one).
    Failed { rank: u32, message: String, peer: Option<u32> },
}

impl Msg {
    /// A `Hello` of this protocol version.
    pub fn hello(rank: u32, data_addr: String) -> Msg {
        Msg::Hello { magic: MAGIC, version: PROTOCOL_VERSION, rank, data_addr }
    }
}

/// Control-protocol failures.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("connection closed")]
    Closed,
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    #[error("frame of {0} bytes exceeds the {MAX_FRAME}-byte limit: not a shardtrain control connection?")]
    TooLarge(usize),
    #[error("cannot decode a control message ({0}): are the launcher and the worker the same build?")]
    Decode(String),
    #[error("cannot encode a control message: {0}")]
    Encode(String),
}

/// Encode one message as a length-prefixed frame.
pub fn encode(msg: &Msg) -> Result<Vec<u8>, ProtocolError> {
    let body = bincode::serde::encode_to_vec(msg, bincode::config::standard())
        .map_err(|e| ProtocolError::Encode(e.to_string()))?;
    let len = u32::try_from(body.len()).map_err(|_| ProtocolError::TooLarge(body.len()))?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

fn decode(body: &[u8]) -> Result<Msg, ProtocolError> {
    let (msg, used) = bincode::serde::decode_from_slice(body, bincode::config::standard())
        .map_err(|e| ProtocolError::Decode(e.to_string()))?;
    if used != body.len() {
        return Err(ProtocolError::Decode(format!("{} trailing bytes", body.len() - used)));
    }
    Ok(msg)
}

fn frame_len(header: [u8; 4]) -> Result<usize, ProtocolError> {
    let len = u32::from_le_bytes(header) as usize;
    if len > MAX_FRAME {
        return Err(ProtocolError::TooLarge(len));
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
    let mut body = vec![0u8; frame_len(header)?];
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
    let mut header = [0u8; 4];
    r.read_exact(&mut header).await.map_err(map_eof)?;
    let mut body = vec![0u8; frame_len(header)?];
    r.read_exact(&mut body).await.map_err(map_eof)?;
    decode(&body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let msgs = [
            Msg::hello(3, "127.0.0.1:4000".into()),
            Msg::Start { world: 2, peers: vec!["a:1".into(), "b:2".into()], nccl_id: Some(vec![7; 128]) },
            Msg::Done { rank: 1 },
            Msg::Failed { rank: 0, message: "boom".into(), peer: Some(1) },
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
        assert!(matches!(recv(&mut r), Err(ProtocolError::TooLarge(_))));
        let mut frame = 3u32.to_le_bytes().to_vec();
        frame.extend_from_slice(&[0xff, 0xff, 0xff]);
        assert!(matches!(recv(&mut &frame[..]), Err(ProtocolError::Decode(_))));
    }
}
