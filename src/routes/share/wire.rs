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

/// The process that made a handle: its host, the host's boot, its pid and its start time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Origin {
    pub(crate) host: [u8; 16],
    pub(crate) boot: [u8; 16],
    pub(crate) pid: u32,
    /// The process's start, in clock ticks after the boot (`/proc/PID/stat`'s 22nd field).
    pub(crate) start: u64,
}

/// Sixteen bytes from the 32 hexadecimal digits of `text` (dashes and whitespace skipped).
fn id_bytes(text: &str) -> Option<[u8; 16]> {
    let digits: Vec<u8> = text
        .bytes()
        .filter(|b| !b.is_ascii_whitespace() && *b != b'-')
        .collect();
    if digits.len() != 32 {
        return None;
    }
    let mut id = [0u8; 16];
    for (i, pair) in digits.chunks(2).enumerate() {
        let pair = std::str::from_utf8(pair).ok()?;
        id[i] = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(id)
}

/// The 128-bit id in the first of `paths` that holds one.
fn read_id(what: &'static str, paths: &[&str]) -> Result<[u8; 16], ShareError> {
    for path in paths {
        if let Some(id) = std::fs::read_to_string(path)
            .ok()
            .as_deref()
            .and_then(id_bytes)
        {
            return Ok(id);
        }
    }
    Err(ShareError::Identity {
        what,
        reason: format!("none of {paths:?} holds a 128-bit id"),
    })
}

/// The host's id: its machine id, or, on a host without one (a minimal container), 128 bits
/// of its name (two FNV-1a hashes), which tells hosts apart as far as their names do.
fn host_id() -> Result<[u8; 16], ShareError> {
    read_id("host", &["/etc/machine-id", "/var/lib/dbus/machine-id"]).or_else(|missing| {
        let name = std::fs::read_to_string("/proc/sys/kernel/hostname").map_err(|_| missing)?;
        let fnv = |seed: u64| {
            name.trim().bytes().fold(seed, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            })
        };
        let mut id = [0u8; 16];
        id[..8].copy_from_slice(&fnv(0xcbf2_9ce4_8422_2325).to_le_bytes());
        id[8..].copy_from_slice(&fnv(0x8422_2325_cbf2_9ce4).to_le_bytes());
        Ok(id)
    })
}

/// The start time of process `pid`, if it is alive (`/proc/PID/stat`, the field after the
/// command's closing parenthesis's nineteenth).
fn start_of(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command may hold spaces and parentheses: the fields start after the last `)`.
    let rest = &stat[stat.rfind(')')? + 1..];
    let field: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (the state); the start time is field 22.
    let start = field.get(22 - 3)?.parse().ok()?;
    // A zombie has exited: its memory is gone, whatever its table entry says.
    (field.first() != Some(&"Z")).then_some(start)
}

impl Origin {
    /// This process.
    ///
    /// # Errors
    /// [`ShareError::Identity`] when the host's or the boot's id cannot be read.
    pub(crate) fn here() -> Result<Origin, ShareError> {
        let pid = std::process::id();
        Ok(Origin {
            host: host_id()?,
            boot: read_id("boot", &["/proc/sys/kernel/random/boot_id"])?,
            pid,
            start: start_of(pid).ok_or(ShareError::Identity {
                what: "process",
                reason: format!("/proc/{pid}/stat has no start time"),
            })?,
        })
    }

    /// Checks that the process this names is a live process of this host's current boot.
    ///
    /// # Errors
    /// [`ShareError::OtherHost`], [`ShareError::OtherBoot`] or [`ShareError::ProcessGone`].
    pub(crate) fn check(&self, here: &Origin) -> Result<(), ShareError> {
        if self.host != here.host {
            return Err(ShareError::OtherHost);
        }
        if self.boot != here.boot {
            return Err(ShareError::OtherBoot);
        }
        if start_of(self.pid) != Some(self.start) {
            return Err(ShareError::ProcessGone { pid: self.pid });
        }
        Ok(())
    }
}

/// An exporter's offer of one tensor; the exporting pool's file descriptor travels with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Offer {
    /// The tensor's number among the exporter's.
    pub(crate) id: u64,
    pub(crate) origin: Origin,
    /// The UUID of the device that holds it.
    pub(crate) device: [u8; 16],
    /// Its element type's code.
    pub(crate) dtype: u8,
    pub(crate) shape: Vec<u64>,
    pub(crate) bytes: u64,
    /// The allocation's export data (`CUmemPoolPtrExportData`).
    pub(crate) pointer: [u8; 64],
    /// The inter-process event after the exporter's writes (`CUipcEventHandle`).
    pub(crate) event: [u8; 64],
}

/// A message of the sharing protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Message {
    /// An exporter's offer, with the pool's file descriptor beside it.
    Offer(Box<Offer>),
    /// An importer's release of its import of tensor `id`.
    Release { id: u64 },
    /// A refusal of the other side's last message, and why.
    Refuse { reason: String },
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

impl Message {
    fn kind(&self) -> u8 {
        match self {
            Message::Offer(_) => OFFER,
            Message::Release { .. } => RELEASE,
            Message::Refuse { .. } => REFUSE,
        }
    }

    fn body(&self) -> Vec<u8> {
        let mut body = Vec::new();
        match self {
            Message::Offer(o) => {
                body.extend_from_slice(&o.id.to_le_bytes());
                body.extend_from_slice(&o.origin.host);
                body.extend_from_slice(&o.origin.boot);
                body.extend_from_slice(&o.origin.pid.to_le_bytes());
                body.extend_from_slice(&o.origin.start.to_le_bytes());
                body.extend_from_slice(&o.device);
                body.push(o.dtype);
                body.push(o.shape.len() as u8);
                for d in &o.shape {
                    body.extend_from_slice(&d.to_le_bytes());
                }
                body.extend_from_slice(&o.bytes.to_le_bytes());
                body.extend_from_slice(&o.pointer);
                body.extend_from_slice(&o.event);
            }
            Message::Release { id } => body.extend_from_slice(&id.to_le_bytes()),
            Message::Refuse { reason } => body.extend_from_slice(reason.as_bytes()),
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
                let origin = Origin {
                    host: b.take()?,
                    boot: b.take()?,
                    pid: u32::from_le_bytes(b.take()?),
                    start: b.u64()?,
                };
                let device = b.take()?;
                let [dtype, dims] = b.take()?;
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
                    shape,
                    bytes: b.u64()?,
                    pointer: b.take()?,
                    event: b.take()?,
                };
                b.end()?;
                Ok(Message::Offer(Box::new(offer)))
            }
            RELEASE => {
                let mut b = Body {
                    bytes,
                    kind: "a release",
                };
                let id = b.u64()?;
                b.end()?;
                Ok(Message::Release { id })
            }
            REFUSE => Ok(Message::Refuse {
                reason: String::from_utf8_lossy(bytes).into_owned(),
            }),
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
    if fd.is_some() != matches!(message, Message::Offer(_)) {
        return Err(ShareError::Garbage {
            reason: "a descriptor without an offer, or an offer without one".into(),
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
        let mut long = frame(REFUSE, &[]);
        long[MAGIC.len() + 2..HEADER].copy_from_slice(&u32::MAX.to_le_bytes());
        garbage(&long, "at most");
        let cut = frame(RELEASE, &7u64.to_le_bytes());
        garbage(&cut[..cut.len() - 3], "body cut short");
        garbage(&frame(RELEASE, &[1, 2, 3]), "release cut short");
        garbage(&frame(RELEASE, &[0; 9]), "past the end");
        // A forged offer: right in length, but sent without the pool's descriptor.
        let body = Message::Offer(Box::new(offer(Origin::here().unwrap()))).body();
        garbage(&frame(OFFER, &body), "without");
        garbage(&frame(OFFER, &body[..40]), "offer cut short");
        let mut dims = body.clone();
        dims[8 + 16 + 16 + 4 + 8 + 16 + 1] = 200;
        garbage(&frame(OFFER, &dims), "200 dimensions");
    }

    #[test]
    fn a_handle_of_another_host_boot_or_a_gone_process_is_refused() {
        let here = Origin::here().unwrap();
        assert!(here.check(&here).is_ok());
        let other_host = Origin {
            host: [0xaa; 16],
            ..here
        };
        assert!(matches!(
            other_host.check(&here),
            Err(ShareError::OtherHost)
        ));
        let other_boot = Origin {
            boot: [0xbb; 16],
            ..here
        };
        assert!(matches!(
            other_boot.check(&here),
            Err(ShareError::OtherBoot)
        ));
        // A process that has exited, and a pid reused by a later process.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        let alive = Origin {
            pid,
            start: start_of(pid).unwrap(),
            ..here
        };
        assert!(alive.check(&here).is_ok());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(matches!(
            alive.check(&here),
            Err(ShareError::ProcessGone { pid: p }) if p == pid
        ));
        let reused = Origin {
            start: here.start + 1,
            ..here
        };
        assert!(matches!(
            reused.check(&here),
            Err(ShareError::ProcessGone { .. })
        ));
    }

    #[test]
    fn ids_are_read_from_their_text_forms() {
        let id = id_bytes("0123456789abcdef0123456789ABCDEF\n").unwrap();
        assert_eq!(id[0], 0x01);
        assert_eq!(id[15], 0xef);
        assert_eq!(id_bytes("01234567-89ab-cdef-0123-456789abcdef"), Some(id));
        assert_eq!(id_bytes("0123"), None);
        assert_eq!(id_bytes("zz23456789abcdef0123456789abcdef"), None);
    }
}
