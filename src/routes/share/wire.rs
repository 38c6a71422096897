//! The sharing route's wire: the messages an exporting process and its importers exchange on a
//! Unix socket, the identity that tells a handle of this host, this boot and a live process from
//! any other, and the file descriptor an offer carries.
//!
//! Every message is framed: the mark `CFSHARE`, the protocol's version, the message's kind, its
//! body's length, and the body. A reader checks each field as it reads it and refuses, with a
//! typed [`MalformedError`](crate::error::MalformedError) saying which: bytes that are not the protocol, another version, a message
//! cut short, a kind it does not know, a body too long or of the wrong length for its kind, and,
//! for an offer, a handle of another host, of another boot, or of a process that has exited
//! (or whose pid now names another process, which its start time tells apart). A file descriptor
//! that arrives with a message the reader refuses is closed, never leaked.
//!
//! A process is named by its host's machine id (`/etc/machine-id`, or its name where it has
//! none), the boot's id
//! (`/proc/sys/kernel/random/boot_id`), its pid and its start time (`/proc/PID/stat`), so an
//! offer copied to another machine, kept across a reboot, or replayed after its exporter exited
//! is refused before anything is mapped.

// The sharing route is built on these messages; until its export and import are in place, only
// the tests reach them.
#![cfg_attr(not(test), allow(dead_code))]

use crate::driver::share::{Name, Origin};
use crate::error::{Error, IoError, MalformedError, PeerError};
use crate::fd_passing::{recv_with_fds, send_with_fds};
use crate::sync::deadline::Deadline;
use std::io::Write;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// The protocol's mark, which opens every message.
const MAGIC: &[u8; 7] = b"CFSHARE";
/// The protocol's version, after the mark (2: the greeting names its user).
const VERSION: u8 = 2;
/// The mark, the version, the kind and the body's length.
const HEADER: usize = MAGIC.len() + 1 + 1 + 4;
/// The longest body a reader takes.
const MAX_BODY: usize = 64 * 1024;
/// The most dimensions an offered tensor may have.
const MAX_DIMS: usize = 16;
/// The longest reason a refusal may give.
pub(crate) const MAX_REASON: usize = 1024;
/// How long a message may take to arrive whole once its first byte has (where its reader gives
/// no earlier deadline): a peer that trickles one longer is refused, and its connection closed.
pub(crate) const MESSAGE_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);
/// The most descriptors one read takes in: room for this many, so that a peer's extra ones
/// are received (and closed) rather than cut off; past it, the kernel closes them
/// (`MSG_CTRUNC`).
const SEEN_FDS: usize = 16;

const OFFER: u8 = 1;
const RELEASE: u8 = 2;
const REFUSE: u8 = 3;
const HELLO: u8 = 4;
const UNMAP: u8 = 5;
const UNMAPPED: u8 = 6;
const GOODBYE: u8 = 7;

/// What an offer lets its importer do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    /// Read it, beside the exporter and any other importer; the exporter writes it only after
    /// every importer has released it.
    Read,
    /// Read and write it, alone: the exporter has handed its tensor over until it comes back.
    Exclusive,
}

/// An exporter's offer of one tensor; the exporting pool's file descriptor travels with the
/// first on each connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Offer {
    /// The tensor's number among the exporter's.
    pub(crate) id: u64,
    pub(crate) origin: Origin,
    /// The UUID of the device that holds it.
    pub(crate) device: [u8; 16],
    /// Its element type's code.
    pub(crate) dtype: u8,
    /// What the importer may do with it.
    pub(crate) access: Access,
    pub(crate) shape: Vec<u64>,
    pub(crate) bytes: u64,
    /// The allocation's export data (`CUmemPoolPtrExportData`).
    pub(crate) pointer: Name,
    /// The inter-process event after the exporter's writes (`CUipcEventHandle`).
    pub(crate) event: Name,
}

/// An importer's greeting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) origin: Origin,
    /// The importer's (effective) user id, which the kernel's word on the socket must repeat.
    pub(crate) uid: u32,
    /// The UUID of the importer's device.
    pub(crate) device: [u8; 16],
    /// The importer's inter-process event (`CUipcEventHandle`).
    pub(crate) event: Name,
}

/// A message of the sharing protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Message {
    /// An importer's greeting, its first message: who it is, its device, and the event it
    /// records after its last use of each import it releases.
    Hello(Box<Hello>),
    /// An exporter's offer, with the pool's file descriptor beside the first on a connection.
    Offer(Box<Offer>),
    /// An importer's release of its import of tensor `id`: its last use of it (and, for an
    /// exclusive import, its writes) came before its greeting's event's latest record.
    Release { id: u64 },
    /// An importer's refusal of the offer of tensor `id`, and why: nothing of the offer is in
    /// use; `mapped` says whether the importer still maps the tensor from an earlier offer.
    Refuse {
        id: u64,
        mapped: bool,
        reason: String,
    },
    /// An exporter's request that the importer unmap tensor `id` once no import of it is in
    /// use: the exporter wants to free it.
    Unmap { id: u64 },
    /// An importer's word that it has unmapped tensor `id`, ordered before its greeting's
    /// event's latest record: the exporter may free it.
    Unmapped { id: u64 },
    /// An importer's last message: it holds nothing (every mapping it had is unmapped, in the
    /// messages before), and maps no offer that comes after.
    Goodbye,
}

/// A body's reader, each field checked for length.
struct Body<'a> {
    bytes: &'a [u8],
    kind: &'static str,
}

impl Body<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], Error> {
        if self.bytes.len() < N {
            return Err(MalformedError::Sharing {
                reason: format!("{} cut short", self.kind),
            }
            .into());
        }
        let (head, rest) = self.bytes.split_at(N);
        self.bytes = rest;
        Ok(head.try_into().expect("N bytes"))
    }

    fn u64(&mut self) -> Result<u64, Error> {
        self.take::<8>().map(u64::from_le_bytes)
    }

    fn origin(&mut self) -> Result<Origin, Error> {
        Ok(Origin {
            host: self.take()?,
            boot: self.take()?,
            pid: u32::from_le_bytes(self.take()?),
            start: self.u64()?,
        })
    }

    fn end(self) -> Result<(), Error> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(MalformedError::Sharing {
                reason: format!("{} bytes past the end of {}", self.bytes.len(), self.kind),
            }
            .into())
        }
    }
}

/// Appends `origin`'s fields to `body`.
fn put_origin(body: &mut Vec<u8>, origin: &Origin) {
    body.extend_from_slice(&origin.host);
    body.extend_from_slice(&origin.boot);
    body.extend_from_slice(&origin.pid.to_le_bytes());
    body.extend_from_slice(&origin.start.to_le_bytes());
}

impl Message {
    fn kind(&self) -> u8 {
        match self {
            Message::Hello(_) => HELLO,
            Message::Offer(_) => OFFER,
            Message::Release { .. } => RELEASE,
            Message::Refuse { .. } => REFUSE,
            Message::Unmap { .. } => UNMAP,
            Message::Unmapped { .. } => UNMAPPED,
            Message::Goodbye => GOODBYE,
        }
    }

    fn body(&self) -> Vec<u8> {
        let mut body = Vec::new();
        match self {
            Message::Hello(h) => {
                put_origin(&mut body, &h.origin);
                body.extend_from_slice(&h.uid.to_le_bytes());
                body.extend_from_slice(&h.device);
                body.extend_from_slice(&h.event);
            }
            Message::Offer(o) => {
                body.extend_from_slice(&o.id.to_le_bytes());
                put_origin(&mut body, &o.origin);
                body.extend_from_slice(&o.device);
                body.push(o.dtype);
                body.push(match o.access {
                    Access::Read => 0,
                    Access::Exclusive => 1,
                });
                body.push(o.shape.len() as u8);
                for d in &o.shape {
                    body.extend_from_slice(&d.to_le_bytes());
                }
                body.extend_from_slice(&o.bytes.to_le_bytes());
                body.extend_from_slice(&o.pointer);
                body.extend_from_slice(&o.event);
            }
            Message::Release { id } => body.extend_from_slice(&id.to_le_bytes()),
            Message::Refuse { id, mapped, reason } => {
                body.extend_from_slice(&id.to_le_bytes());
                body.push(u8::from(*mapped));
                // At most `MAX_REASON` bytes, cut at a character's boundary.
                let mut end = reason.len().min(MAX_REASON);
                while !reason.is_char_boundary(end) {
                    end -= 1;
                }
                body.extend_from_slice(&reason.as_bytes()[..end]);
            }
            Message::Unmap { id } | Message::Unmapped { id } => {
                body.extend_from_slice(&id.to_le_bytes());
            }
            Message::Goodbye => {}
        }
        body
    }

    fn parse(kind: u8, bytes: &[u8]) -> Result<Message, Error> {
        match kind {
            OFFER => {
                let mut b = Body {
                    bytes,
                    kind: "an offer",
                };
                let id = b.u64()?;
                let origin = b.origin()?;
                let device = b.take()?;
                let [dtype, access, dims] = b.take()?;
                let access = match access {
                    0 => Access::Read,
                    1 => Access::Exclusive,
                    other => {
                        return Err(MalformedError::Sharing {
                            reason: format!("an offer of access {other} (0 or 1)"),
                        }
                        .into());
                    }
                };
                if usize::from(dims) > MAX_DIMS {
                    return Err(MalformedError::Sharing {
                        reason: format!("an offer of {dims} dimensions (at most {MAX_DIMS})"),
                    }
                    .into());
                }
                let shape = (0..dims).map(|_| b.u64()).collect::<Result<_, _>>()?;
                let offer = Offer {
                    id,
                    origin,
                    device,
                    dtype,
                    access,
                    shape,
                    bytes: b.u64()?,
                    pointer: b.take()?,
                    event: b.take()?,
                };
                b.end()?;
                Ok(Message::Offer(Box::new(offer)))
            }
            HELLO => {
                let mut b = Body {
                    bytes,
                    kind: "a greeting",
                };
                let hello = Hello {
                    origin: b.origin()?,
                    uid: u32::from_le_bytes(b.take()?),
                    device: b.take()?,
                    event: b.take()?,
                };
                b.end()?;
                Ok(Message::Hello(Box::new(hello)))
            }
            RELEASE | UNMAP | UNMAPPED => {
                let mut b = Body {
                    bytes,
                    kind: match kind {
                        RELEASE => "a release",
                        UNMAP => "an unmap request",
                        _ => "an unmapping",
                    },
                };
                let id = b.u64()?;
                b.end()?;
                Ok(match kind {
                    RELEASE => Message::Release { id },
                    UNMAP => Message::Unmap { id },
                    _ => Message::Unmapped { id },
                })
            }
            GOODBYE => {
                Body {
                    bytes,
                    kind: "a goodbye",
                }
                .end()?;
                Ok(Message::Goodbye)
            }
            REFUSE => {
                let mut b = Body {
                    bytes,
                    kind: "a refusal",
                };
                let id = b.u64()?;
                let [mapped] = b.take()?;
                let mapped = match mapped {
                    0 => false,
                    1 => true,
                    other => {
                        return Err(MalformedError::Sharing {
                            reason: format!("a refusal whose mapped flag is {other}"),
                        }
                        .into());
                    }
                };
                if b.bytes.len() > MAX_REASON {
                    return Err(MalformedError::Sharing {
                        reason: format!(
                            "a refusal whose reason is {} bytes (at most {MAX_REASON})",
                            b.bytes.len()
                        ),
                    }
                    .into());
                }
                // Control characters (a terminal's escapes) never reach a log as they came.
                let reason = String::from_utf8_lossy(b.bytes)
                    .chars()
                    .map(|c| if c.is_control() { '\u{fffd}' } else { c })
                    .collect();
                Ok(Message::Refuse { id, mapped, reason })
            }
            other => Err(MalformedError::Sharing {
                reason: format!("a message of kind {other}, which the protocol does not have"),
            }
            .into()),
        }
    }
}

/// An operation's failure on the socket, as the route's error.
fn io(operation: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| IoError::Socket { operation, source }.into()
}

/// Sends `message` on `stream`, with `fd` beside it (`SCM_RIGHTS`) when given.
///
/// # Errors
/// [`IoError::Socket`] when the socket refuses.
pub(crate) fn send(
    stream: &mut UnixStream,
    message: &Message,
    fd: Option<BorrowedFd<'_>>,
) -> Result<(), Error> {
    let body = message.body();
    let mut frame = Vec::with_capacity(HEADER + body.len());
    frame.extend_from_slice(MAGIC);
    frame.push(VERSION);
    frame.push(message.kind());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    let Some(fd) = fd else {
        return stream.write_all(&frame).map_err(io("write"));
    };
    // The descriptor rides on the frame's first bytes; the rest follows as a plain write.
    let raw: RawFd = fd.as_raw_fd();
    let sent = send_with_fds(stream.as_raw_fd(), &frame, &[&[raw]], libc::MSG_NOSIGNAL)
        .map_err(io("sendmsg"))?;
    stream.write_all(&frame[sent..]).map_err(io("write"))
}

/// The descriptors that came with a message's bytes, owned as they arrive (so that any refusal
/// closes them all), and whether the kernel cut some off.
#[derive(Default)]
struct Received {
    fds: Vec<OwnedFd>,
    truncated: bool,
}

/// How an operation on the socket that passed its deadline reads.
fn timed_out() -> std::io::Error {
    std::io::ErrorKind::TimedOut.into()
}

/// Waits until `fd` is readable (a message, or its end) or `deadline` passes (`TimedOut`).
fn wait_readable(fd: RawFd, deadline: Deadline) -> std::io::Result<()> {
    loop {
        let millis = match deadline.remaining() {
            None => -1,
            Some(left) if left.is_zero() => return Err(timed_out()),
            // Rounded up, so a wait of under a millisecond does not spin.
            Some(left) => {
                libc::c_int::try_from(left.as_micros().div_ceil(1000)).unwrap_or(libc::c_int::MAX)
            }
        };
        let mut poll = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid `pollfd`, for the duration of the call.
        let ready = unsafe { libc::poll(&mut poll, 1, millis) };
        if ready > 0 {
            return Ok(());
        }
        if ready < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() != std::io::ErrorKind::Interrupted {
                return Err(error);
            }
        }
    }
}

/// Reads what has come into `buf` (at least one byte, or 0 at the end), waiting for it until
/// `deadline`; every descriptor that comes with the bytes goes to `received`.
fn read_some(
    stream: &UnixStream,
    buf: &mut [u8],
    received: &mut Received,
    deadline: Deadline,
) -> std::io::Result<usize> {
    loop {
        // `MSG_DONTWAIT` leaves the wait to `wait_readable`, under the deadline.
        match recv_with_fds(stream.as_raw_fd(), buf, SEEN_FDS, libc::MSG_DONTWAIT) {
            Ok(got) => {
                received.fds.extend(got.fds);
                received.truncated |= got.truncated;
                return Ok(got.bytes);
            }
            Err(error) => match error.kind() {
                std::io::ErrorKind::Interrupted => continue,
                std::io::ErrorKind::WouldBlock => wait_readable(stream.as_raw_fd(), deadline)?,
                _ => return Err(error),
            },
        }
    }
}

/// Fills `buf` whole by `deadline`; `what` names it when the peer ends it early.
fn read_whole(
    stream: &UnixStream,
    mut buf: &mut [u8],
    received: &mut Received,
    deadline: Deadline,
    what: &str,
) -> Result<(), Error> {
    while !buf.is_empty() {
        match read_some(stream, buf, received, deadline) {
            Ok(0) => {
                return Err(MalformedError::Sharing {
                    reason: format!("{what} cut short"),
                }
                .into());
            }
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                return Err(IoError::Socket {
                    operation: "read",
                    source: e,
                }
                .into());
            }
            Err(source) => {
                return Err(IoError::Socket {
                    operation: "recvmsg",
                    source,
                }
                .into());
            }
        }
    }
    Ok(())
}

/// Receives one message from `stream`, with the file descriptor that came with it, if any,
/// as [`recv_by`] does: whole within the stream's read timeout of the call (for ever without
/// one), and within [`MESSAGE_LIMIT`] of its first byte.
///
/// # Errors
/// As [`recv_by`].
pub(crate) fn recv(stream: &mut UnixStream) -> Result<(Message, Option<OwnedFd>), Error> {
    let within = stream.read_timeout().map_err(|source| IoError::Socket {
        operation: "getsockopt",
        source,
    })?;
    recv_by(stream, within.map_or(Deadline::never(), Deadline::after))
}

/// Receives one message from `stream`, whole by `deadline` (its first byte included), and
/// within [`MESSAGE_LIMIT`] of its first byte whatever the deadline: a peer that trickles it
/// is refused however slowly each byte comes. The stream's own read timeout plays no part
/// here.
///
/// Only an offer carries a descriptor, one at most: every descriptor that comes with any other
/// message, beside an offer's first, or with control data the kernel cut short
/// (`MSG_CTRUNC`) is closed, and the message refused.
///
/// # Errors
/// [`IoError::Socket`] when the socket fails, of kind `TimedOut` when the message is not whole
/// by its deadline; [`PeerError::Closed`] when the peer closed it before a message began, and
/// [`MalformedError::Sharing`] for bytes that are not the protocol (the descriptors that came with
/// them are closed).
pub(crate) fn recv_by(
    stream: &mut UnixStream,
    deadline: Deadline,
) -> Result<(Message, Option<OwnedFd>), Error> {
    let stream = &*stream;
    let mut header = [0u8; HEADER];
    // The descriptors, owned from here so that every refusal below closes them.
    let mut received = Received::default();
    let got = match read_some(stream, &mut header, &mut received, deadline) {
        Ok(got) => got,
        Err(source) => {
            let operation = if source.kind() == std::io::ErrorKind::TimedOut {
                "read"
            } else {
                "recvmsg"
            };
            return Err(IoError::Socket { operation, source }.into());
        }
    };
    let check_fds = |received: &Received, may: usize| {
        if received.truncated {
            return Err(MalformedError::Sharing {
                reason: format!(
                    "more descriptors than one read takes ({SEEN_FDS}) beside a message"
                ),
            });
        }
        if received.fds.len() > may {
            return Err(MalformedError::Sharing {
                reason: format!(
                    "{} descriptors with a message that may carry {may}",
                    received.fds.len()
                ),
            });
        }
        Ok(())
    };
    if got == 0 {
        check_fds(&received, 0)?;
        return Err(PeerError::Closed.into());
    }
    // The rest of the message comes within its limit of the first byte.
    let whole = deadline.min(Deadline::after(MESSAGE_LIMIT));
    read_whole(
        stream,
        &mut header[got..],
        &mut received,
        whole,
        "a message's header",
    )?;
    if &header[..MAGIC.len()] != MAGIC {
        return Err(MalformedError::Sharing {
            reason: "bytes that do not open with the protocol's mark".into(),
        }
        .into());
    }
    if header[MAGIC.len()] != VERSION {
        return Err(MalformedError::Sharing {
            reason: format!(
                "protocol version {}, where this process speaks {VERSION}",
                header[MAGIC.len()]
            ),
        }
        .into());
    }
    let kind = header[MAGIC.len() + 1];
    let len = u32::from_le_bytes(header[MAGIC.len() + 2..].try_into().expect("four bytes"));
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    if len > MAX_BODY {
        return Err(MalformedError::Sharing {
            reason: format!("a body of {len} bytes (at most {MAX_BODY})"),
        }
        .into());
    }
    let mut body = vec![0u8; len];
    read_whole(stream, &mut body, &mut received, whole, "a message's body")?;
    let message = Message::parse(kind, &body)?;
    // Only an offer carries a descriptor (the first on a connection: the pool's).
    check_fds(&received, usize::from(matches!(message, Message::Offer(_))))?;
    Ok((message, received.fds.pop()))
}

/// The process at the other end of `stream`, as the kernel reports it (`SO_PEERCRED`): the
/// process that connected it (or listened, for a connecting side; or made the pair, for a
/// socket pair), as of then.
///
/// # Errors
/// [`IoError::Socket`] when the kernel does not say.
pub(crate) fn peer(stream: &UnixStream) -> Result<Peer, Error> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a `ucred` the call fills, `len` its size; the descriptor is the
    // stream's, open for the call.
    let ok = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if ok != 0 {
        return Err(IoError::Socket {
            operation: "getsockopt(SO_PEERCRED)",
            source: std::io::Error::last_os_error(),
        }
        .into());
    }
    match u32::try_from(cred.pid) {
        Ok(pid) if pid != 0 => Ok(Peer { pid, uid: cred.uid }),
        // A socket the kernel names no process for (not a connected Unix socket).
        _ => Err(IoError::Socket {
            operation: "getsockopt(SO_PEERCRED)",
            source: std::io::ErrorKind::NotConnected.into(),
        }
        .into()),
    }
}

/// This process's effective user id, which its greeting names.
pub(crate) fn own_uid() -> u32 {
    // SAFETY: `geteuid` has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The process at a socket's other end, as the kernel reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Peer {
    /// Its process id.
    pub(crate) pid: u32,
    /// Its effective user id.
    pub(crate) uid: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsFd;

    fn offer(origin: Origin) -> Offer {
        Offer {
            id: 7,
            origin,
            device: [3; 16],
            dtype: 2,
            access: Access::Exclusive,
            shape: vec![4, 1024],
            bytes: 16384,
            pointer: [9; 64],
            event: [5; 64],
        }
    }

    #[test]
    fn an_offer_and_its_descriptor_and_a_release_travel_whole() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let here = Origin::here().unwrap();
        let (read_end, mut write_end) = std::io::pipe().unwrap();
        let sent = Message::Offer(Box::new(offer(here)));
        send(&mut a, &sent, Some(read_end.as_fd())).unwrap();
        send(&mut a, &Message::Release { id: 7 }, None).unwrap();
        let (got, fd) = recv(&mut b).unwrap();
        assert_eq!(got, sent);
        // The descriptor received is the pipe's read end.
        write_end.write_all(b"through").unwrap();
        let mut through = [0u8; 7];
        std::fs::File::from(fd.unwrap())
            .read_exact(&mut through)
            .unwrap();
        assert_eq!(&through, b"through");
        let (release, fd) = recv(&mut b).unwrap();
        assert_eq!(release, Message::Release { id: 7 });
        assert!(fd.is_none());
        drop(a);
        assert!(matches!(recv(&mut b), Err(Error::Peer(PeerError::Closed))));
    }

    /// `bytes` on a socket, then the reader's answer.
    fn read_back(bytes: &[u8]) -> Result<(Message, Option<OwnedFd>), Error> {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        a.write_all(bytes).unwrap();
        drop(a);
        recv(&mut b)
    }

    fn garbage(bytes: &[u8], says: &str) {
        match read_back(bytes) {
            Err(Error::Malformed(MalformedError::Sharing { reason })) => {
                assert!(reason.contains(says), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }

    fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut f = MAGIC.to_vec();
        f.push(VERSION);
        f.push(kind);
        f.extend_from_slice(&(body.len() as u32).to_le_bytes());
        f.extend_from_slice(body);
        f
    }

    #[test]
    fn bytes_that_are_not_the_protocol_are_refused_saying_why() {
        garbage(b"GET / HTTP/1.1\r\n\r\n", "mark");
        garbage(b"CFSH", "header cut short");
        let mut other = frame(RELEASE, &7u64.to_le_bytes());
        other[MAGIC.len()] = 9;
        garbage(&other, "version 9");
        garbage(&frame(42, &[]), "kind 42");
        let mut long = frame(REFUSE, &[0; 9]);
        long[MAGIC.len() + 2..HEADER].copy_from_slice(&u32::MAX.to_le_bytes());
        garbage(&long, "at most");
        let cut = frame(RELEASE, &7u64.to_le_bytes());
        garbage(&cut[..cut.len() - 3], "body cut short");
        garbage(&frame(RELEASE, &[1, 2, 3]), "release cut short");
        garbage(&frame(RELEASE, &[0; 9]), "past the end");
        let body = Message::Offer(Box::new(offer(Origin::here().unwrap()))).body();
        garbage(&frame(OFFER, &body[..40]), "offer cut short");
        let mut dims = body.clone();
        dims[8 + 16 + 16 + 4 + 8 + 16 + 2] = 200;
        garbage(&frame(OFFER, &dims), "200 dimensions");
    }

    /// How many of this process's descriptors name the pipe whose write end is `write_end`
    /// (its read ends and the write end itself).
    fn open_on_pipe(write_end: &std::io::PipeWriter) -> usize {
        // `pipe:[INODE]`, which every end of the pipe reads as.
        let name = std::fs::read_link(format!("/proc/self/fd/{}", write_end.as_raw_fd())).unwrap();
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|target| *target == name)
            .count()
    }

    /// Sends `bytes` with `fds` beside them, in one `SCM_RIGHTS` header per group.
    fn send_raw(stream: &UnixStream, bytes: &[u8], groups: &[&[RawFd]]) {
        let sent = crate::fd_passing::send_with_fds(stream.as_raw_fd(), bytes, groups, 0);
        assert_eq!(sent.unwrap(), bytes.len());
    }

    #[test]
    fn every_descriptor_beyond_what_a_message_carries_is_closed() {
        let release = frame(RELEASE, &7u64.to_le_bytes());
        let offer = frame(
            OFFER,
            &Message::Offer(Box::new(offer(Origin::here().unwrap()))).body(),
        );
        // (the message, how many descriptors in each header, whether it is taken)
        let cases: [(&[u8], &[usize], bool); 7] = [
            (&release, &[1], false),
            (&release, &[2], false),
            (&offer, &[1], true),
            (&offer, &[2], false),
            (&offer, &[1, 1], false),
            (&offer, &[3, 2], false),
            // More than a read takes in: the kernel cuts the control data short.
            (&offer, &[100], false),
        ];
        for (bytes, groups, taken) in cases {
            let (read_end, write_end) = std::io::pipe().unwrap();
            let raw = read_end.as_raw_fd();
            let fds: Vec<Vec<RawFd>> = groups.iter().map(|&n| vec![raw; n]).collect();
            let groups_ref: Vec<&[RawFd]> = fds.iter().map(Vec::as_slice).collect();
            let (mut a, mut b) = UnixStream::pair().unwrap();
            send_raw(&a, bytes, &groups_ref);
            drop(read_end);
            // Only the copies in flight, and the write end.
            let got = recv(&mut b);
            assert_eq!(got.is_ok(), taken, "{groups:?}: {:?}", got.as_ref().err());
            if let Err(Error::Malformed(MalformedError::Sharing { reason })) = &got {
                assert!(reason.contains("descriptor"), "{reason}");
            }
            let kept = got.ok().and_then(|(_, fd)| fd);
            assert_eq!(
                open_on_pipe(&write_end),
                1 + usize::from(kept.is_some()),
                "{groups:?}: a descriptor left open"
            );
            drop(kept);
            // The link is still whole after a refusal of its descriptors: nothing more comes.
            drop(a.shutdown(std::net::Shutdown::Write));
            assert!(matches!(recv(&mut b), Err(Error::Peer(PeerError::Closed))));
            let _ = &mut a;
        }
    }

    #[test]
    fn a_message_trickled_byte_by_byte_times_out_as_a_whole() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let trickler = std::thread::spawn(move || {
            let mut a = a;
            for byte in frame(RELEASE, &7u64.to_le_bytes()) {
                if a.write_all(&[byte]).is_err() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        });
        let limit = std::time::Duration::from_millis(300);
        let start = std::time::Instant::now();
        match recv_by(&mut b, Deadline::after(limit)) {
            Err(Error::Io(IoError::Socket { source, .. })) => {
                assert_eq!(source.kind(), std::io::ErrorKind::TimedOut);
            }
            other => panic!("{other:?}"),
        }
        assert!(start.elapsed() < limit * 2, "{:?}", start.elapsed());
        drop(b);
        trickler.join().unwrap();
    }

    #[test]
    fn a_refusals_reason_is_bounded_and_shown_without_control_characters() {
        let long = Message::Refuse {
            id: 1,
            mapped: false,
            reason: "é".repeat(MAX_REASON),
        };
        let (mut a, mut b) = UnixStream::pair().unwrap();
        send(&mut a, &long, None).unwrap();
        match recv(&mut b).unwrap().0 {
            Message::Refuse { reason, .. } => assert!(reason.len() <= MAX_REASON),
            other => panic!("{other:?}"),
        }
        let mut body = 1u64.to_le_bytes().to_vec();
        body.push(0);
        body.extend(std::iter::repeat_n(b'x', MAX_REASON + 1));
        garbage(&frame(REFUSE, &body), "at most 1024");
        let mut body = 1u64.to_le_bytes().to_vec();
        body.push(0);
        body.extend_from_slice(b"\x1b[2Jgone");
        match read_back(&frame(REFUSE, &body)).unwrap().0 {
            Message::Refuse { reason, .. } => assert_eq!(reason, "\u{fffd}[2Jgone"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_field_of_an_offer_is_checked_as_it_is_parsed() {
        let body = Message::Offer(Box::new(offer(Origin::here().unwrap()))).body();
        // The access: 0 or 1.
        let mut access = body.clone();
        access[8 + 44 + 16 + 1] = 2;
        garbage(&frame(OFFER, &access), "access 2");
        // The rank: at most `MAX_DIMS`.
        let mut rank = body.clone();
        rank[8 + 44 + 16 + 2] = (MAX_DIMS + 1) as u8;
        garbage(&frame(OFFER, &rank), "at most 16");
        // Cut at every byte (every field, the shape's dimensions, the export data and the
        // event's handle): cut short; a byte past the end: refused.
        for cut in 0..body.len() {
            garbage(&frame(OFFER, &body[..cut]), "offer cut short");
        }
        let mut long = body.clone();
        long.push(0);
        garbage(&frame(OFFER, &long), "past the end of an offer");
    }
}
