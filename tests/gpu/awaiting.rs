//! Awaiting pending transfers on a real device: woken by the driver's stream callbacks, on
//! tokio's current-thread and multi-thread runtimes.

use crate::common::{distinct_f32, open};
use cuferry::{
    CudaEngine, PinnedHostBuffer, download_pending, download_tensor, upload_pending, upload_tensor,
};
use tokio::runtime::{Builder, Runtime};

/// 16 B (done before the first poll, or nearly) and 64 MiB (in flight at the first poll).
const SIZES: [usize; 2] = [16, 64 << 20];

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
    let data = distinct_f32(n);
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

#[test]
#[ignore = "needs a CUDA device"]
fn uploads_and_downloads_awaited_on_a_current_thread_runtime() {
    let mut engine = open();
    let rt = current_thread();
    for bytes in SIZES {
        round_trip(&mut engine, &rt, bytes);
    }
    // Awaited in place too, without a task: the runtime's own thread is woken.
    let data = distinct_f32(SIZES[1] / 4);
    let value = upload_tensor(&mut engine, &data, &[data.len()]).unwrap();
    let buffer = PinnedHostBuffer::<f32>::new(&mut engine, data.len()).unwrap();
    let download = download_pending(&mut engine, value, buffer).unwrap();
    let returned = rt.block_on(async { download.await }).unwrap();
    assert_eq!(returned.buffer().as_slice(), &data[..]);
    engine.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn uploads_and_downloads_awaited_on_a_multi_thread_runtime() {
    let mut engine = open();
    let rt = multi_thread();
    for bytes in SIZES {
        round_trip(&mut engine, &rt, bytes);
    }
    engine.synchronize().unwrap();
}

/// More transfers awaited at once than the driver has side streams for its callbacks: they
/// share them, and every one is still woken with its data in place.
#[test]
#[ignore = "needs a CUDA device"]
fn many_transfers_awaited_at_once_all_complete() {
    let mut engine = open();
    let rt = multi_thread();
    let count = 40;
    let mut tasks = Vec::new();
    let mut expected = Vec::new();
    for k in 0..count {
        let n = if k % 4 == 0 { (8 << 20) / 4 } else { 4 };
        let data: Vec<f32> = distinct_f32(n).iter().map(|x| x + k as f32).collect();
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
}
