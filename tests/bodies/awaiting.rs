//! `.await` on pending transfers, on either device: on tokio's current-thread and multi-thread
//! runtimes and on futures-lite's minimal executor, each transfer woken with its data in place.

use super::Device;
use cuferry::{
    CudaEngine, PinnedHostBuffer, RegisteredBuffer, download_pending, download_tensor,
    upload_pending, upload_tensor,
};
use std::time::Duration;
use tokio::runtime::{Builder, Runtime};

/// 16 B (done before the first poll, or nearly) and 64 MiB (in flight at the first poll).
const SIZES: [usize; 2] = [16, 64 << 20];

/// Per-index distinct values: never zeros, never repeating within 2^24.
fn distinct(n: usize) -> Vec<f32> {
    (0..n).map(|i| (i % (1 << 24)) as f32 * 0.5 + 1.0).collect()
}

fn current_thread() -> Runtime {
    Builder::new_current_thread().build().unwrap()
}

fn multi_thread() -> Runtime {
    Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap()
}

/// Uploads and downloads `bytes` with both transfers awaited on `rt`, each in a task of its own
/// (on a worker thread, for a multi-thread runtime), and checks the data both ways.
fn round_trip(engine: &mut CudaEngine, rt: &Runtime, bytes: usize) {
    let n = bytes / 4;
    let data = distinct(n);
    let source = PinnedHostBuffer::from_slice(engine, &data).unwrap();
    let destination = engine.alloc_tensor::<f32>(&[n]).unwrap();
    let upload = upload_pending(engine, source, destination).unwrap();
    let returned = rt
        .block_on(rt.spawn(async move { upload.await }))
        .unwrap()
        .unwrap();
    let (mut buffer, tensor) = returned.into_parts();
    assert_eq!(
        download_tensor(engine, &tensor).unwrap(),
        data,
        "{bytes} B up"
    );

    buffer.as_mut_slice().fill(-1.0); // poison
    let download = download_pending(engine, tensor, buffer).unwrap();
    let returned = rt
        .block_on(rt.spawn(async move { download.await }))
        .unwrap()
        .unwrap();
    assert_eq!(returned.buffer().as_slice(), &data[..], "{bytes} B down");
}

pub(crate) fn uploads_and_downloads_awaited_on_a_current_thread_runtime(dev: Device) {
    let mut engine = dev.engine();
    let rt = current_thread();
    for bytes in SIZES {
        round_trip(&mut engine, &rt, bytes);
    }
    // Awaited in place too, without a task: the runtime's own thread is woken.
    let data = distinct(SIZES[1] / 4);
    let value = upload_tensor(&mut engine, &data, &[data.len()]).unwrap();
    let buffer = PinnedHostBuffer::<f32>::new(&mut engine, data.len()).unwrap();
    let download = download_pending(&mut engine, value, buffer).unwrap();
    let returned = rt.block_on(async { download.await }).unwrap();
    assert_eq!(returned.buffer().as_slice(), &data[..]);
    engine.synchronize().unwrap();
    Device::no_violations(&engine);
}

pub(crate) fn uploads_and_downloads_awaited_on_a_multi_thread_runtime(dev: Device) {
    let mut engine = dev.engine();
    let rt = multi_thread();
    for bytes in SIZES {
        round_trip(&mut engine, &rt, bytes);
    }
    engine.synchronize().unwrap();
    Device::no_violations(&engine);
}

/// More transfers awaited at once than the driver has side streams for its callbacks: they
/// share them, and every one is still woken with its data in place.
pub(crate) fn many_transfers_awaited_at_once_all_complete(dev: Device) {
    let mut engine = dev.engine();
    let rt = multi_thread();
    let count = 40;
    let mut tasks = Vec::new();
    let mut expected = Vec::new();
    for k in 0..count {
        let n = if k % 4 == 0 { (8 << 20) / 4 } else { 4 };
        let data: Vec<f32> = distinct(n).iter().map(|x| x + k as f32).collect();
        let source = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
        let destination = engine.alloc_tensor::<f32>(&[n]).unwrap();
        let upload = upload_pending(&mut engine, source, destination).unwrap();
        tasks.push(rt.spawn(async move { upload.await }));
        expected.push(data);
    }
    for (task, data) in tasks.into_iter().zip(expected) {
        let returned = rt.block_on(task).unwrap().unwrap();
        assert_eq!(
            download_tensor(&mut engine, returned.tensor()).unwrap(),
            data
        );
    }
    engine.synchronize().unwrap();
    Device::no_violations(&engine);
}

/// An upload from a registered `Vec`, work on its in-flight destination, and a download into a
/// second registered `Vec`, all awaited: both `Vec`s come back with the data.
pub(crate) fn transfers_over_registered_buffers_are_awaited_and_hand_their_vec_back(dev: Device) {
    let mut engine = dev.engine();
    let sim = engine.sim();
    // Simulator only: the clock is held, so both transfers are still queued when awaited, and a
    // thread of the test runs the device one operation at a time.
    if let Some(sim) = &sim {
        sim.hold_clock(true);
    }
    let data = crate::support::distinct_salted(4096, 7);
    let source = RegisteredBuffer::register(&mut engine, data.clone()).unwrap();
    let destination = engine.alloc_tensor::<u32>(&[4096]).unwrap();
    let upload = upload_pending(&mut engine, source, destination).unwrap();
    // Work on the in-flight destination, then a download into a second registered buffer.
    let copy = engine.copy_tensor(upload.tensor()).unwrap();
    let target = RegisteredBuffer::register(&mut engine, vec![0u32; 4096]).unwrap();
    let download = download_pending(&mut engine, copy, target).unwrap();
    let advancer = sim.clone().map(|sim| {
        std::thread::spawn(move || {
            while sim.queued() > 0 {
                std::thread::sleep(Duration::from_millis(1));
                sim.advance(1);
            }
        })
    });
    let (upload, download) = futures_lite::future::block_on(async {
        let download = download.await;
        let upload = upload.await;
        (upload, download)
    });
    if let Some(advancer) = advancer {
        advancer.join().unwrap();
    }
    if let Some(sim) = &sim {
        sim.hold_clock(false);
    }
    let (_, target) = download.unwrap().into_parts();
    assert_eq!(target.into_vec().unwrap(), data);
    let (source, _) = upload.unwrap().into_parts();
    assert_eq!(source.into_vec().unwrap(), data);
    if let Some(sim) = &sim {
        assert_eq!(sim.registered_live().0, 0);
    }
    Device::no_violations(&engine);
}

/// Every body of this module as tests of one binary: `tests!(sim)` in the simulator's, `tests!(gpu)`
/// in the GPU suite's, so both run the same list.
macro_rules! tests {
    ($device:ident) => {
        crate::bodies!($device; awaiting::{
            uploads_and_downloads_awaited_on_a_current_thread_runtime,
            uploads_and_downloads_awaited_on_a_multi_thread_runtime,
            many_transfers_awaited_at_once_all_complete,
            transfers_over_registered_buffers_are_awaited_and_hand_their_vec_back,
        });
    };
}
pub(crate) use tests;
