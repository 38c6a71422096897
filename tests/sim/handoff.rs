//! The in-flight handoff on the simulated device: work queued on the engine reads the device side
//! of a transfer that is still in flight, with no host wait, and sees the data the copy lands.
//!
//! Host waits are counted by the simulator (event and stream synchronizes); "nothing ran yet" is
//! its queue: with the clock held, queued work runs only when a test advances it.

use crate::support::sim_engine as engine;
use crate::support::{Reference, Rng, random_vec};
use cuferry::graph::{GraphCompiler, Input, TracedTensor};
use cuferry::sim::{SimDevice, SimOp};
use cuferry::{
    DType, Element, Error, PinnedHostBuffer, SubmitError, download_pending, download_tensor,
    error::DriverError, upload_pending, upload_tensor,
};

// Written once in `tests/bodies/handoff.rs`, run here on the simulated device and by the GPU
// suite on device 0.
crate::bodies::handoff::tests!(sim);

/// Host waits the device has seen so far.
fn host_waits(sim: &SimDevice) -> u64 {
    sim.calls(SimOp::EventSynchronize) + sim.calls(SimOp::StreamSynchronize)
}

/// Upload, device copy of the in-flight destination, pending download of the copy, one wait: for
/// one element type at one length.
fn chain_through_a_device_copy<T: Reference + Element>(rng: &mut Rng, n: usize) {
    let (mut engine, sim) = engine();
    sim.hold_clock(true);
    let data: Vec<T> = random_vec(rng, n);
    let source = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let destination = engine.alloc_tensor::<T>(&[n]).unwrap();
    let waits = host_waits(&sim);

    let upload = upload_pending(&mut engine, source, destination).unwrap();
    let copy = engine.copy_tensor(upload.tensor()).unwrap();
    let buffer = PinnedHostBuffer::<T>::new(&mut engine, n).unwrap();
    let download = download_pending(&mut engine, copy, buffer).unwrap();
    assert!(
        sim.queued() > 0,
        "{}: the chain is queued, not run",
        T::DTYPE
    );
    assert_eq!(host_waits(&sim), waits, "{}: no host wait", T::DTYPE);

    sim.hold_clock(false);
    let download = download.wait().unwrap();
    assert_eq!(host_waits(&sim), waits + 1, "{}: one host wait", T::DTYPE);
    let got = download.buffer().as_slice().to_vec();
    crate::support::assert_same(&format!("{} n={n}", T::DTYPE), &got, &data);
    // The upload completed before the download in stream order: its proof needs no wait.
    let upload = match upload.try_wait().unwrap() {
        cuferry::pending::TryWait::Returned(r) => r,
        cuferry::pending::TryWait::InFlight(_) => panic!("{}: stream order", T::DTYPE),
    };
    assert_eq!(host_waits(&sim), waits + 1);
    drop((upload, download));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

#[test]
fn every_element_type_reads_an_in_flight_destination_with_one_host_wait() {
    let mut rng = Rng::new(0x4a4d);
    // 1 element, 16 bytes' worth and one past it, and a length of several pages.
    for n in [1usize, 2, 16, 17, 4097] {
        for_each_element!(T => {
            // `bool` cannot come back through a pending download (any byte may be on the device):
            // it is checked through a blocking download below.
            if T::DTYPE != DType::Bool {
                chain_through_a_device_copy::<T>(&mut rng, n);
            }
        });
    }
}

#[test]
fn a_bool_destination_in_flight_is_read_in_stream_order() {
    let (mut engine, sim) = engine();
    sim.hold_clock(true);
    let data: Vec<bool> = (0..33).map(|i| i % 3 == 0).collect();
    let source = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let destination = engine.alloc_tensor::<bool>(&[33]).unwrap();
    let upload = upload_pending(&mut engine, source, destination).unwrap();
    let copy = engine.copy_tensor(upload.tensor()).unwrap();
    sim.hold_clock(false);
    assert_eq!(download_tensor(&mut engine, &copy).unwrap(), data);
    drop(upload.wait().unwrap());
}

#[test]
fn kernels_and_a_prepared_program_read_an_in_flight_upload_without_host_waits() {
    let (mut engine, sim) = engine();
    sim.hold_clock(true);
    let data: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
    let source = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let destination = engine.alloc_tensor::<f32>(&[1000]).unwrap();

    let x = TracedTensor::input_symbolic_shape(DType::F32, 1);
    let y = (&(&x * &x).unwrap() + &x).unwrap();
    let program = GraphCompiler::new()
        .compile_with_input_specs(&[&y], &[(&x, DType::F32, &[1000])])
        .unwrap();
    let mut prepared = engine.prepare(&program).unwrap();
    let waits = host_waits(&sim);

    let upload = upload_pending(&mut engine, source, destination).unwrap();
    let doubled = engine.add(upload.tensor(), upload.tensor()).unwrap();
    let scaled = engine.scale(&doubled, 0.25f32).unwrap();
    let outputs = engine
        .run(&mut prepared, &[Input::from(upload.tensor())])
        .unwrap();
    let program_out = outputs
        .into_iter()
        .next()
        .unwrap()
        .into_tensor::<f32>()
        .unwrap();
    let buffer = PinnedHostBuffer::<f32>::new(&mut engine, 1000).unwrap();
    let download = download_pending(&mut engine, scaled, buffer).unwrap();
    assert_eq!(host_waits(&sim), waits, "nothing waited on the host");
    assert!(sim.queued() > 0);

    sim.hold_clock(false);
    let download = download.wait().unwrap();
    let want: Vec<f32> = data.iter().map(|v| (v + v) * 0.25).collect();
    assert_eq!(download.buffer().as_slice(), &want[..]);
    assert_eq!(
        host_waits(&sim),
        waits + 1,
        "the download's wait is the only one"
    );
    let want: Vec<f32> = data.iter().map(|v| v * v + v).collect();
    assert_eq!(download_tensor(&mut engine, &program_out).unwrap(), want);
    drop(upload.wait().unwrap());
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

#[test]
fn the_source_of_an_in_flight_download_is_readable_alongside_the_copy() {
    let (mut engine, sim) = engine();
    let data: Vec<i32> = (0..512).map(|i| i * 3 - 100).collect();
    let tensor = upload_tensor(&mut engine, &data, &[512]).unwrap();
    sim.hold_clock(true);
    let buffer = PinnedHostBuffer::<i32>::new(&mut engine, 512).unwrap();
    let download = download_pending(&mut engine, tensor, buffer).unwrap();
    let negated = engine.neg(download.tensor()).unwrap();
    let copy = engine.copy_tensor(download.tensor()).unwrap();
    sim.hold_clock(false);
    let want: Vec<i32> = data.iter().map(|v| -v).collect();
    assert_eq!(download_tensor(&mut engine, &negated).unwrap(), want);
    assert_eq!(download_tensor(&mut engine, &copy).unwrap(), data);
    let download = download.wait().unwrap();
    assert_eq!(download.buffer().as_slice(), &data[..]);
}

#[test]
fn a_failed_kernel_in_the_middle_leaves_the_transfers_intact() {
    let (mut engine, sim) = engine();
    sim.hold_clock(true);
    let data: Vec<f64> = (0..64).map(f64::from).collect();
    let source = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let destination = engine.alloc_tensor::<f64>(&[64]).unwrap();
    let upload = upload_pending(&mut engine, source, destination).unwrap();
    // Warm the kernel so the fault hits the launch, not the compile.
    let warm = engine.alloc_tensor::<f64>(&[1]).unwrap();
    drop(engine.add(&warm, &warm).unwrap());
    sim.fail_nth(SimOp::Launch, 1, DriverError::LAUNCH_FAILED);
    assert!(matches!(
        engine.add(upload.tensor(), upload.tensor()),
        Err(Error::Driver { .. })
    ));
    // The chain goes on after the refused step.
    let copy = engine.copy_tensor(upload.tensor()).unwrap();
    let buffer = PinnedHostBuffer::<f64>::new(&mut engine, 64).unwrap();
    let download = download_pending(&mut engine, copy, buffer).unwrap();
    sim.hold_clock(false);
    assert_eq!(download.wait().unwrap().buffer().as_slice(), &data[..]);
    let upload = upload.wait().unwrap();
    assert_eq!(upload.buffer().as_slice(), &data[..]);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

#[test]
fn a_refused_download_in_the_middle_returns_its_package_and_the_upload_still_lands() {
    let (mut engine, sim) = engine();
    sim.hold_clock(true);
    let data: Vec<u16> = (0..300).collect();
    let source = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let destination = engine.alloc_tensor::<u16>(&[300]).unwrap();
    let upload = upload_pending(&mut engine, source, destination).unwrap();
    let copy = engine.copy_tensor(upload.tensor()).unwrap();
    let buffer = PinnedHostBuffer::<u16>::new(&mut engine, 300).unwrap();
    sim.fail_nth(SimOp::CopyDtoH, 1, DriverError::LAUNCH_FAILED);
    let package = match download_pending(&mut engine, copy, buffer) {
        Err(SubmitError::Failed { input: package, .. }) => package,
        other => panic!("expected a failed submission, got {other:?}"),
    };
    // Resubmitted as it came back, the chain completes.
    let download = download_pending(&mut engine, package.0, package.1).unwrap();
    sim.hold_clock(false);
    assert_eq!(download.wait().unwrap().buffer().as_slice(), &data[..]);
    drop(upload.wait().unwrap());
}

#[test]
fn a_failed_upload_event_is_reported_while_the_work_after_it_still_lands() {
    let (mut engine, sim) = engine();
    sim.hold_clock(true);
    let data: Vec<u8> = (0..=255).collect();
    let source = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let destination = engine.alloc_tensor::<u8>(&[256]).unwrap();
    // The next event recorded is the upload's.
    sim.fail_event(1, DriverError::LAUNCH_FAILED);
    let upload = upload_pending(&mut engine, source, destination).unwrap();
    let copy = engine.copy_tensor(upload.tensor()).unwrap();
    let buffer = PinnedHostBuffer::<u8>::new(&mut engine, 256).unwrap();
    let download = download_pending(&mut engine, copy, buffer).unwrap();
    sim.hold_clock(false);
    assert_eq!(download.wait().unwrap().buffer().as_slice(), &data[..]);
    let (pinned_before, _) = sim.pinned_live();
    assert!(matches!(upload.wait(), Err(Error::DeviceFault { .. })));
    let (pinned_after, _) = sim.pinned_live();
    assert_eq!(
        pinned_before, pinned_after,
        "the upload's buffer is retained"
    );
    assert_eq!(engine.retirement_stats().retained, 1);
}

#[test]
fn dropping_an_upload_after_handing_off_its_destination_frees_nothing_early() {
    let (mut engine, sim) = engine();
    sim.hold_clock(true);
    let data: Vec<u32> = (0..2048).map(|i| i * 7 + 1).collect();
    let source = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let destination = engine.alloc_tensor::<u32>(&[2048]).unwrap();
    let upload = upload_pending(&mut engine, source, destination).unwrap();
    let copy = engine.copy_tensor(upload.tensor()).unwrap();
    drop(upload);
    assert_eq!(engine.retirement_stats().pending, 1);
    sim.hold_clock(false);
    assert_eq!(download_tensor(&mut engine, &copy).unwrap(), data);
    engine.synchronize().unwrap();
    assert_eq!(engine.retirement_stats().pending, 0);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}
