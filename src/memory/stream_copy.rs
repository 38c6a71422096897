//! Copies into pinned staging memory with non-temporal stores.
//!
//! A staged upload writes the caller's data into pinned memory, then has the device read it over
//! PCIe. Written with ordinary stores, the data sits dirty in the CPU's caches, and the device's
//! reads have to pull it out of them: a host copy followed by its DMA takes far longer than the
//! two alone (`midsize_anatomy_8MiB` in `benches/transfer_paths.rs`;
//! `docs/records/mid-size-transfers.md`). Non-temporal stores write around the caches, to memory,
//! where the DMA reads it.
//!
//! The stores are weakly ordered, so the copy ends with a store fence: whoever learns that the
//! copy is done (the thread that queues the DMA, through the routes' counters) sees every byte.

/// Below this many bytes an ordinary copy is used: streaming stores made smaller uploads slower,
/// and uploads from this size up faster (`benches/transfer_sweep.rs`;
/// `docs/records/mid-size-transfers.md`).
const STREAM_MIN: usize = 64 << 10;

/// Copies `len` bytes from `src` to `dst`, with non-temporal stores where the platform has them
/// (x86-64), then a store fence; elsewhere an ordinary copy.
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`]: `src..src+len` is readable, `dst..dst+len` writable,
/// and they do not overlap.
pub(crate) unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if len >= STREAM_MIN {
            // SAFETY: the caller's contract.
            unsafe { x86_64::copy(dst, src, len) };
            return;
        }
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

#[cfg(target_arch = "x86_64")]
mod x86_64 {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};

    /// The non-temporal copy: an ordinary copy up to `dst`'s first 16-byte boundary, 16-byte
    /// streaming stores (64 bytes per round) up to the last boundary, a store fence, and an
    /// ordinary copy of the tail. SSE2, which every x86-64 processor has.
    ///
    /// # Safety
    /// As [`super::copy_streaming`].
    pub(super) unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) {
        let head = dst.align_offset(16).min(len);
        // SAFETY: `head <= len`: inside both ranges, which do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        let mut offset = head;
        // SAFETY: `offset + 64` (or `+ 16`) is at most `len`, so each load reads inside `src`'s
        // range and each store writes inside `dst`'s; `dst + offset` is 16-byte aligned (`head`
        // aligned it, and `offset` grows by multiples of 16), as `_mm_stream_si128` needs; the
        // loads need no alignment; SSE2 is part of every x86-64 target.
        unsafe {
            while offset + 64 <= len {
                let s = src.add(offset).cast::<__m128i>();
                let d = dst.add(offset).cast::<__m128i>();
                let (a, b) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
                let (c, e) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
                offset += 64;
            }
            while offset + 16 <= len {
                let s = src.add(offset).cast::<__m128i>();
                _mm_stream_si128(dst.add(offset).cast::<__m128i>(), _mm_loadu_si128(s));
                offset += 16;
            }
            // The streaming stores are weakly ordered: make them visible before anything the
            // caller does next (its release of the "copied" counter, the DMA's enqueue).
            _mm_sfence();
        }
        // SAFETY: `offset <= len`: the tail lies inside both ranges.
        unsafe { std::ptr::copy_nonoverlapping(src.add(offset), dst.add(offset), len - offset) };
    }
}

#[cfg(test)]
mod tests {
    use super::copy_streaming;

    #[test]
    fn copies_every_length_and_alignment_exactly() {
        let src: Vec<u8> = (0..70_100u32).map(|i| (i * 7 + 3) as u8).collect();
        for len in [
            0, 1, 15, 16, 17, 63, 64, 65, 4095, 4096, 4097, 8191, 12_345, 19_000,
        ] {
            for src_off in [0, 1, 7, 16] {
                for dst_off in [0, 1, 9, 16] {
                    let mut dst = vec![0xEEu8; 70_100];
                    // SAFETY: both ranges lie inside their vectors, which do not overlap.
                    unsafe {
                        copy_streaming(
                            dst.as_mut_ptr().add(dst_off),
                            src.as_ptr().add(src_off),
                            len,
                        )
                    };
                    assert_eq!(
                        &dst[dst_off..dst_off + len],
                        &src[src_off..src_off + len],
                        "len {len}, src +{src_off}, dst +{dst_off}"
                    );
                    assert!(
                        dst[..dst_off].iter().all(|&b| b == 0xEE),
                        "before the range"
                    );
                    assert!(
                        dst[dst_off + len..].iter().all(|&b| b == 0xEE),
                        "after the range"
                    );
                }
            }
        }
    }
}
