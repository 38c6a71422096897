//! The sharing route's wire: the messages an exporting process and its importers exchange on a
//! Unix socket, the identity that tells a handle of this host, this boot and a live process from
//! any other, and the file descriptor an offer carries.
//!
//! Every message is framed: the mark `CFSHARE`, the protocol's version, the message's kind, its
//! body's length, and the body. A reader checks each field as it reads it and refuses, with a
//! typed [`ShareError`] saying which: bytes that are not the protocol, another version, a message
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
use crate::error::ShareError;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// The protocol's mark, which opens every message.
const MAGIC: &[u8; 7] = b"CFSHARE";
/// The protocol's version, after the mark.
const VERSION: u8 = 1;
/// The mark, the version, the kind and the body's length.
const HEADER: usize = MAGIC.len() + 1 + 1 + 4;
/// The longest body a reader takes.
const MAX_BODY: usize = 64 * 1024;
/// The most dimensions an offered tensor may have.
const MAX_DIMS: usize = 16;

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
    fn take<const N: usize>(&mut self) -> Result<[u8; N], ShareError> {
        if self.bytes.len() < N {
            return Err(ShareError::Garbage {
                reason: format!("{} cut short", self.kind),
            });
        }
        let (head, rest) = self.bytes.split_at(N);
        self.bytes = rest;
        Ok(head.try_into().expect("N bytes"))
    }

    fn u64(&mut self) -> Result<u64, ShareError> {
        self.take::<8>().map(u64::from_le_bytes)
    }

    fn origin(&mut self) -> Result<Origin, ShareError> {
        Ok(Origin {
            host: self.take()?,
            boot: self.take()?,
            pid: u32::from_le_bytes(self.take()?),
            start: self.u64()?,
        })
    }

    fn end(self) -> Result<(), ShareError> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(ShareError::Garbage {
                reason: format!("{} bytes past the end of {}", self.bytes.len(), self.kind),
            })
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
                body.extend_from_slice(reason.as_bytes());
            }
            Message::Unmap { id } | Message::Unmapped { id } => {
                body.extend_from_slice(&id.to_le_bytes());
            }
            Message::Goodbye => {}
        }
        body
    }

    fn parse(kind: u8, bytes: &[u8]) -> Result<Message, ShareError> {
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
                        return Err(ShareError::Garbage {
                            reason: format!("an offer of access {other} (0 or 1)"),
                        });
                    }
                };
                if usize::from(dims) > MAX_DIMS {
                    return Err(ShareError::Garbage {
                        reason: format!("an offer of {dims} dimensions (at most {MAX_DIMS})"),
                    });
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
                        return Err(ShareError::Garbage {
                            reason: format!("a refusal whose mapped flag is {other}"),
                        });
                    }
                };
                Ok(Message::Refuse {
                    id,
                    mapped,
                    reason: String::from_utf8_lossy(b.bytes).into_owned(),
                })
            }
            other => Err(ShareError::Garbage {
                reason: format!("a message of kind {other}, which the protocol does not have"),
            }),
        }
    }
}

/// An operation's failure on the socket, as the route's error.
fn io(operation: &'static str) -> impl FnOnce(std::io::Error) -> ShareError {
    move |source| ShareError::Io { operation, source }
}

/// Sends `message` on `stream`, with `fd` beside it (`SCM_RIGHTS`) when given.
///
/// # Errors
/// [`ShareError::Io`] when the socket refuses.
pub(crate) fn send(
    stream: &mut UnixStream,
    message: &Message,
    fd: Option<BorrowedFd<'_>>,
) -> Result<(), ShareError> {
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
    let mut control = [0u8; CONTROL];
    let mut iov = libc::iovec {
        iov_base: frame.as_mut_ptr().cast(),
        iov_len: frame.len(),
    };
    // SAFETY: an all-zero `msghdr` is a valid empty header; its pointers are set below to
    // buffers that outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() as _;
    // SAFETY: `msg` has a control buffer of `CMSG_SPACE(sizeof(int))` bytes, so the first
    // header exists and has room for one descriptor.
    unsafe {
        let header = libc::CMSG_FIRSTHDR(&msg);
        (*header).cmsg_level = libc::SOL_SOCKET;
        (*header).cmsg_type = libc::SCM_RIGHTS;
        (*header).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(header).cast::<RawFd>(), raw);
    }
    // SAFETY: `msg` and the buffers it points to are valid for the call.
    let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    let sent = usize::try_from(sent).map_err(|_| ShareError::Io {
        operation: "sendmsg",
        source: std::io::Error::last_os_error(),
    })?;
    stream.write_all(&frame[sent..]).map_err(io("write"))
}

/// The control buffer of a message that carries one descriptor: `CMSG_SPACE(sizeof(int))`.
// SAFETY: `CMSG_SPACE` is arithmetic on its argument (unsafe only by its C heritage).
const CONTROL: usize = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;

/// Receives one message from `stream`, with the file descriptor that came with it, if any.
///
/// # Errors
/// [`ShareError::Io`] when the socket fails, [`ShareError::Closed`] when the peer closed it
/// before a message began, and [`ShareError::Garbage`] for bytes that are not the protocol (a
/// descriptor that came with them is closed).
pub(crate) fn recv(stream: &mut UnixStream) -> Result<(Message, Option<OwnedFd>), ShareError> {
    let mut header = [0u8; HEADER];
    let mut control = [0u8; CONTROL];
    let mut iov = libc::iovec {
        iov_base: header.as_mut_ptr().cast(),
        iov_len: header.len(),
    };
    // SAFETY: as in `send`.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() as _;
    // SAFETY: `msg` and its buffers are valid for the call; `MSG_CMSG_CLOEXEC` keeps a received
    // descriptor out of child processes.
    let got = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    let got = usize::try_from(got).map_err(|_| ShareError::Io {
        operation: "recvmsg",
        source: std::io::Error::last_os_error(),
    })?;
    // The descriptor, owned from here so that every refusal below closes it.
    let mut fd = None;
    // SAFETY: the kernel filled `msg`'s control buffer; the headers are walked as CMSG_* say.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let raw = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<RawFd>());
                // SAFETY: the kernel just installed `raw` in this process for us alone.
                fd = Some(OwnedFd::from_raw_fd(raw));
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(ShareError::Garbage {
            reason: "more descriptors than one message carries".into(),
        });
    }
    if got == 0 {
        return Err(ShareError::Closed);
    }
    stream
        .read_exact(&mut header[got..])
        .map_err(|e| cut_short(e, "a message's header"))?;
    if &header[..MAGIC.len()] != MAGIC {
        return Err(ShareError::Garbage {
            reason: "bytes that do not open with the protocol's mark".into(),
        });
    }
    if header[MAGIC.len()] != VERSION {
        return Err(ShareError::Garbage {
            reason: format!(
                "protocol version {}, where this process speaks {VERSION}",
                header[MAGIC.len()]
            ),
        });
    }
    let kind = header[MAGIC.len() + 1];
    let len = u32::from_le_bytes(header[MAGIC.len() + 2..].try_into().expect("four bytes"));
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    if len > MAX_BODY {
        return Err(ShareError::Garbage {
            reason: format!("a body of {len} bytes (at most {MAX_BODY})"),
        });
    }
    let mut body = vec![0u8; len];
    stream
        .read_exact(&mut body)
        .map_err(|e| cut_short(e, "a message's body"))?;
    let message = Message::parse(kind, &body)?;
    // Only an offer carries a descriptor (the first on a connection: the pool's).
    if fd.is_some() && !matches!(message, Message::Offer(_)) {
        return Err(ShareError::Garbage {
            reason: "a descriptor with a message other than an offer".into(),
        });
    }
    Ok((message, fd))
}

/// A read that ended early, as the route's error.
fn cut_short(error: std::io::Error, what: &str) -> ShareError {
    if error.kind() == std::io::ErrorKind::UnexpectedEof {
        ShareError::Garbage {
            reason: format!("{what} cut short"),
        }
    } else {
        ShareError::Io {
            operation: "read",
            source: error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
        assert!(matches!(recv(&mut b), Err(ShareError::Closed)));
    }

    /// `bytes` on a socket, then the reader's answer.
    fn read_back(bytes: &[u8]) -> Result<(Message, Option<OwnedFd>), ShareError> {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        a.write_all(bytes).unwrap();
        drop(a);
        recv(&mut b)
    }

    fn garbage(bytes: &[u8], says: &str) {
        match read_back(bytes) {
            Err(ShareError::Garbage { reason }) => assert!(reason.contains(says), "{reason}"),
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
}
