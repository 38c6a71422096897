//! NCCL all-reduce through the crate beside the raw NCCL call, in the same run.
//!
//! Two engines (GPU 0 and GPU 1) and a `Communicator` over them; for 8 MiB, 64 MiB, 256 MiB and
//! 1 GiB of `f32` per rank: the median time of `all_reduce` (sum, in place) and its `wait`,
//! against raw `ncclAllReduce` on a second pair of communicators (`ncclCommInitAll`), in place on
//! buffers from `cuMemAlloc`, on a stream of each device, in one `ncclGroupStart`/`ncclGroupEnd`,
//! each followed by an event record and its wait. Prints the bus bandwidth of each (NCCL's
//! measure: bytes × 2(n−1)/n over the time; for two ranks, bytes over the time) and their ratio.
//! Run on a machine with two GPUs and NCCL: `cargo bench --bench collectives`. Otherwise it
//! prints why and measures nothing.

mod raw;

use cudarc::driver::sys;
use cuferry::{
    collective::{Communicator, ReduceOp},
    upload_tensor,
};
use raw::{check, context, event, stream};
use std::ffi::{c_int, c_void};
use std::time::Duration;

/// The median time of `f`: see `raw::median_within`.
fn median(f: impl FnMut()) -> Duration {
    raw::median_within(Duration::from_secs(1), 500, f)
}

type Comm = *mut c_void;
type InitAll = unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> c_int;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    *mut c_void,
) -> c_int;
type Group = unsafe extern "C" fn() -> c_int;

fn main() {
    let Some((mut a, mut b)) = raw::two_gpus("collectives") else {
        return;
    };
    let comm = match Communicator::new(&mut [&mut a, &mut b]) {
        Ok(comm) => comm,
        Err(e) => {
            eprintln!("collectives: {e}; nothing measured");
            return;
        }
    };
    println!("NCCL {:?}", Communicator::nccl_version().unwrap());
    // The raw side: NCCL's own entry points, loaded as the crate loads them.
    // SAFETY: loading NCCL runs only its own initialisers; each symbol's type is its `nccl.h`
    // declaration.
    let (lib, init_all, all_reduce_raw, group_start, group_end) = unsafe {
        let lib = libloading::Library::new("libnccl.so.2")
            .or_else(|_| libloading::Library::new("libnccl.so"))
            .unwrap();
        let init_all: InitAll = *lib.get(b"ncclCommInitAll").unwrap();
        let all_reduce_raw: AllReduce = *lib.get(b"ncclAllReduce").unwrap();
        let group_start: Group = *lib.get(b"ncclGroupStart").unwrap();
        let group_end: Group = *lib.get(b"ncclGroupEnd").unwrap();
        (lib, init_all, all_reduce_raw, group_start, group_end)
    };
    let (ca, cb) = (context(&mut a), context(&mut b));
    let mut comms = [std::ptr::null_mut(); 2];
    // SAFETY: room for two communicators; two device ordinals.
    let status = unsafe { init_all(comms.as_mut_ptr(), 2, [0, 1].as_ptr()) };
    assert_eq!(status, 0, "ncclCommInitAll");
    let streams = [stream(ca), stream(cb)];
    let events = [event(ca), event(cb)];
    for (bytes, label) in [
        (8usize << 20, "8 MiB"),
        (64 << 20, "64 MiB"),
        (256 << 20, "256 MiB"),
        (1 << 30, "1 GiB"),
    ] {
        let n = bytes / 4;
        let ones = vec![1.0f32; n];
        let mut tensors = vec![
            upload_tensor(&mut a, &ones, &[n]).unwrap(),
            upload_tensor(&mut b, &ones, &[n]).unwrap(),
        ];
        let ours = median(|| {
            let taken = std::mem::take(&mut tensors);
            tensors = comm
                .group()
                .all_reduce(taken, ReduceOp::Sum)
                .submit(&mut [&mut a, &mut b])
                .unwrap()
                .wait()
                .unwrap()
                .into_parts();
        });
        let mut bufs = [0u64; 2];
        // SAFETY: live contexts; out pointers valid; each buffer holds `bytes` bytes and is idle
        // once both waits return; streams and comms belong to the buffers' devices.
        let raw = unsafe {
            for (buf, ctx) in bufs.iter_mut().zip([ca, cb]) {
                check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx));
                check("cuMemAlloc", sys::cuMemAlloc_v2(buf, bytes));
            }
            let raw = median(|| {
                assert_eq!(group_start(), 0);
                for i in 0..2 {
                    let p = bufs[i] as *mut c_void;
                    assert_eq!(
                        all_reduce_raw(p, p, n, 7, 0, comms[i], streams[i] as *mut c_void),
                        0
                    );
                }
                assert_eq!(group_end(), 0);
                for (i, ctx) in [ca, cb].into_iter().enumerate() {
                    check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx));
                    check("cuEventRecord", sys::cuEventRecord(events[i], streams[i]));
                }
                for e in events {
                    check("cuEventSynchronize", sys::cuEventSynchronize(e));
                }
            });
            for (buf, ctx) in bufs.into_iter().zip([ca, cb]) {
                check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx));
                check("cuMemFree", sys::cuMemFree_v2(buf));
            }
            raw
        };
        let busbw = |t: Duration| bytes as f64 / t.as_secs_f64() / (1u64 << 30) as f64;
        println!(
            "{label:>8}: all_reduce + wait {:9.1} µs (bus {:6.1} GiB/s), raw ncclAllReduce + wait {:9.1} µs (bus {:6.1} GiB/s): {:.3}× the raw bus bandwidth",
            ours.as_secs_f64() * 1e6,
            busbw(ours),
            raw.as_secs_f64() * 1e6,
            busbw(raw),
            raw.as_secs_f64() / ours.as_secs_f64()
        );
    }
    drop(lib);
}
