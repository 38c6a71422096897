//! Descriptors passed over a Unix socket beside bytes (`SCM_RIGHTS`), written once.
//!
//! A share sends its memory pool's descriptor to another process this way, and the simulated
//! device's tests carry a pool's descriptor over a real socket the same way, so both go through
//! these two calls: [`send_with_fds`] puts each group of descriptors in one control header of one
//! `sendmsg`, and [`recv_with_fds`] owns every descriptor the kernel installed, however many
//! headers carried them, and says whether the kernel cut some off. The module sits below every
//! level because the route above the seam and the simulator below it both need it.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// The bytes of a control buffer with room for `fds` descriptors in one header:
/// `CMSG_SPACE(fds * sizeof(int))`.
pub(crate) const fn control_space(fds: usize) -> usize {
    // SAFETY: `CMSG_SPACE` is arithmetic on its argument (unsafe only by its C heritage).
    unsafe { libc::CMSG_SPACE((fds * std::mem::size_of::<RawFd>()) as u32) as usize }
}

/// Sends `bytes` on the socket `socket` with `groups` of descriptors beside them, each group in
/// one `SCM_RIGHTS` header, in one `sendmsg` with `flags` (`MSG_NOSIGNAL`, say). Returns how
/// many of the bytes the kernel took: the descriptors went with the first of them, and the
/// rest may follow as plain writes.
///
/// # Errors
/// The operating system's error when `sendmsg` fails.
pub(crate) fn send_with_fds(
    socket: RawFd,
    bytes: &[u8],
    groups: &[&[RawFd]],
    flags: libc::c_int,
) -> std::io::Result<usize> {
    let space: usize = groups.iter().map(|g| control_space(g.len())).sum();
    // In `u64`s, so that the buffer is aligned for the headers it holds.
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr().cast_mut().cast(),
        iov_len: bytes.len(),
    };
    // SAFETY: an all-zero `msghdr` is a valid empty header; its pointers are set below to
    // buffers that outlive the call (the kernel only reads `iov_base` on a send).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if space > 0 {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
    }
    // SAFETY: the control buffer holds `CMSG_SPACE` of every group, so walking it with
    // `CMSG_FIRSTHDR`/`CMSG_NXTHDR` gives one header per group, each with room for its
    // descriptors; unaligned writes, as `CMSG_DATA` promises no alignment.
    unsafe {
        let mut header = libc::CMSG_FIRSTHDR(&msg);
        for group in groups {
            debug_assert!(!header.is_null());
            (*header).cmsg_level = libc::SOL_SOCKET;
            (*header).cmsg_type = libc::SCM_RIGHTS;
            (*header).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(*group) as u32) as _;
            let data = libc::CMSG_DATA(header).cast::<RawFd>();
            for (i, fd) in group.iter().enumerate() {
                std::ptr::write_unaligned(data.add(i), *fd);
            }
            header = libc::CMSG_NXTHDR(&msg, header);
        }
    }
    // SAFETY: `msg` and the buffers it points to are valid for the call.
    let sent = unsafe { libc::sendmsg(socket, &msg, flags) };
    usize::try_from(sent).map_err(|_| std::io::Error::last_os_error())
}

/// What one `recvmsg` brought: how many bytes, the descriptors that came with them (owned, so
/// that dropping them closes them), and whether the kernel cut descriptors off for want of
/// room (`MSG_CTRUNC`: those were closed by the kernel).
pub(crate) struct Received {
    /// The bytes read into the buffer (0 at the end of the stream).
    pub(crate) bytes: usize,
    /// Every descriptor installed in this process by the message.
    pub(crate) fds: Vec<OwnedFd>,
    /// Whether the control buffer was too small for what was sent.
    pub(crate) truncated: bool,
}

/// Receives into `buf` on the socket `socket` with `flags` (`MSG_CMSG_CLOEXEC` is always
/// added), with room for `room` descriptors: every descriptor that came, in however many
/// `SCM_RIGHTS` headers, is owned by the result.
///
/// # Errors
/// The operating system's error when `recvmsg` fails (`WouldBlock` under `MSG_DONTWAIT`,
/// `Interrupted`): nothing was received.
pub(crate) fn recv_with_fds(
    socket: RawFd,
    buf: &mut [u8],
    room: usize,
    flags: libc::c_int,
) -> std::io::Result<Received> {
    let space = control_space(room);
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero `msghdr` is a valid empty header; its pointers are set below to
    // buffers that outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` and its buffers are valid for the call; `MSG_CMSG_CLOEXEC` keeps a
    // received descriptor out of child processes.
    let got = unsafe { libc::recvmsg(socket, &mut msg, flags | libc::MSG_CMSG_CLOEXEC) };
    let bytes = usize::try_from(got).map_err(|_| std::io::Error::last_os_error())?;
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `msg`'s control buffer (at most `msg_controllen` bytes); the
    // headers are walked as CMSG_* say, and each `SCM_RIGHTS` header's data holds
    // `(cmsg_len - CMSG_LEN(0)) / sizeof(int)` descriptors, each installed in this process for
    // us alone, so each is owned here exactly once.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let len = ((*c).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                for i in 0..len / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(Received {
        bytes,
        fds,
        truncated: msg.msg_flags & libc::MSG_CTRUNC != 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn descriptors_in_several_headers_all_arrive_owned_and_a_short_buffer_says_so() {
        let (tx, rx) = UnixStream::pair().unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        let sent = send_with_fds(
            tx.as_raw_fd(),
            b"abc",
            &[&[a.as_raw_fd()], &[b.as_raw_fd(), a.as_raw_fd()]],
            0,
        )
        .unwrap();
        assert_eq!(sent, 3);
        let mut buf = [0u8; 8];
        let got = recv_with_fds(rx.as_raw_fd(), &mut buf, 4, 0).unwrap();
        assert_eq!((got.bytes, &buf[..3]), (3, &b"abc"[..]));
        assert_eq!(got.fds.len(), 3);
        assert!(!got.truncated);
        for fd in &got.fds {
            assert_ne!(fd.as_raw_fd(), a.as_raw_fd());
        }
        // Room for one of three (the buffer's padding may fit a second): the kernel says it cut
        // the rest off, and what did come is owned.
        send_with_fds(
            tx.as_raw_fd(),
            b"d",
            &[&[a.as_raw_fd(), b.as_raw_fd(), a.as_raw_fd()]],
            0,
        )
        .unwrap();
        let got = recv_with_fds(rx.as_raw_fd(), &mut buf, 1, 0).unwrap();
        assert_eq!(got.bytes, 1);
        assert!(got.truncated);
        assert!((1..3).contains(&got.fds.len()), "{}", got.fds.len());
    }
}
