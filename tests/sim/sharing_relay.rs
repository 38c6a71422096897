//! A relay between an importer and its exporter, as a hostile process between them would sit:
//! it passes the sharing protocol's frames on (each descriptor with the frame it came with),
//! rewriting the exporter's offers as a test asks. Used by the simulated and the GPU sharing
//! tests (`#[path]`).

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;

/// The mark, the version, the kind and the body's length.
const HEADER: usize = 7 + 1 + 1 + 4;
/// An offer's kind.
const OFFER: u8 = 1;
/// Where an offer's rank lies in its body: the id, the origin (host, boot, pid, start), the
/// device, the element type and the access.
const RANK_AT: usize = 8 + (16 + 16 + 4 + 8) + 16 + 2;

/// Rewrites an offer's body so that it claims `elements` in its first dimension and `bytes`.
pub(crate) fn claim(body: &mut [u8], elements: u64, bytes: u64) {
    let rank = usize::from(body[RANK_AT]);
    let shape = RANK_AT + 1;
    body[shape..shape + 8].copy_from_slice(&elements.to_le_bytes());
    let at = shape + rank * 8;
    body[at..at + 8].copy_from_slice(&bytes.to_le_bytes());
}

/// One frame's header, read with the descriptor that came with it.
fn recv_header(from: &UnixStream) -> Option<([u8; HEADER], Option<OwnedFd>)> {
    let mut header = [0u8; HEADER];
    // Room for one descriptor's control message (and then some).
    let mut control = [0u64; 8];
    let mut iov = libc::iovec {
        iov_base: header.as_mut_ptr().cast(),
        iov_len: HEADER,
    };
    // SAFETY: an all-zero `msghdr` is a valid empty header; its pointers are set below to
    // buffers that outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: `msg` and its buffers are valid for the call.
    let got = unsafe { libc::recvmsg(from.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    let got = usize::try_from(got).ok().filter(|&n| n > 0)?;
    let mut fd = None;
    // SAFETY: the kernel filled the control buffer; its headers are walked as CMSG_* say, and
    // a descriptor in it was installed for this process alone.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let raw = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<RawFd>());
                fd = Some(OwnedFd::from_raw_fd(raw));
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    (&*from).read_exact(&mut header[got..]).ok()?;
    Some((header, fd))
}

/// Sends `frame` on `to`, with `fd` beside its first byte.
fn send_frame(to: &UnixStream, frame: &[u8], fd: Option<&OwnedFd>) -> Option<()> {
    let Some(fd) = fd else {
        return (&*to).write_all(frame).ok();
    };
    let mut control = [0u64; 8];
    let mut iov = libc::iovec {
        iov_base: frame.as_ptr() as *mut _,
        iov_len: 1,
    };
    // SAFETY: as in `recv_header`.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: `CMSG_SPACE` is arithmetic.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as _;
    // SAFETY: the control buffer has room for one descriptor's header, set here.
    unsafe {
        let header = libc::CMSG_FIRSTHDR(&msg);
        (*header).cmsg_level = libc::SOL_SOCKET;
        (*header).cmsg_type = libc::SCM_RIGHTS;
        (*header).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(header).cast::<RawFd>(), fd.as_raw_fd());
    }
    // SAFETY: `msg` and the buffers it points to are valid for the call; the frame's first
    // byte is not modified through the pointer.
    let sent = unsafe { libc::sendmsg(to.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    (sent == 1).then_some(())?;
    (&*to).write_all(&frame[1..]).ok()
}

/// Relays between `importer` and `exporter` until either ends: the importer's bytes as they
/// come, and the exporter's frames through `rewrite` (given each offer's number, from 0, and its
/// body).
pub(crate) fn relay(
    importer: UnixStream,
    exporter: UnixStream,
    mut rewrite: impl FnMut(usize, &mut Vec<u8>) + Send + 'static,
) -> JoinHandle<()> {
    let (mut up_from, mut up_to) = (importer.try_clone().unwrap(), exporter.try_clone().unwrap());
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut up_from, &mut up_to);
        let _ = up_to.shutdown(std::net::Shutdown::Write);
    });
    std::thread::spawn(move || {
        let mut offers = 0;
        while let Some((header, fd)) = recv_header(&exporter) {
            let len = u32::from_le_bytes(header[9..13].try_into().unwrap()) as usize;
            let mut body = vec![0u8; len];
            if (&exporter).read_exact(&mut body).is_err() {
                break;
            }
            if header[8] == OFFER {
                rewrite(offers, &mut body);
                offers += 1;
            }
            let mut frame = header.to_vec();
            frame[9..13].copy_from_slice(&(body.len() as u32).to_le_bytes());
            frame.extend_from_slice(&body);
            if send_frame(&importer, &frame, fd.as_ref()).is_none() {
                break;
            }
        }
        let _ = importer.shutdown(std::net::Shutdown::Write);
    })
}
