//! What an engine reports of its memory (`CudaEngine::memory`, `MemoryWatch`), checked against
//! what each test allocated through every route and against the simulated device's own count of
//! what is live (its device, pinned and registered memory), up to the teardown, after which
//! nothing is held; the allocation history and its callers' locations; an out-of-memory error's
//! every field.

use cuferry::engine::{Change, Holding, MemoryUse, Owner};
use cuferry::sim::{SimConfig, SimDevice};
use cuferry::{
    CudaEngine, Error, PinnedHostBuffer, RegisteredBuffer, download_tensor, upload_pending,
    upload_tensor,
};

fn engine() -> (CudaEngine, SimDevice) {
    let sim = SimDevice::new(SimConfig::default());
    (CudaEngine::simulated_on(&sim), sim)
}

/// The engine's figures agree with what the simulated device holds live: device memory in the
/// engine's pool (the only engine on `sim`), page-locked memory, registered memory. Waits for
/// the engine first, twice: the first wait releases what retired work held (a free the ledger
/// counts once it is queued), the second runs those frees on the device.
fn agrees(engine: &mut CudaEngine, sim: &SimDevice) -> MemoryUse {
    engine.synchronize().unwrap();
    engine.synchronize().unwrap();
    let m = engine.memory();
    let own_device = m.tensors.in_use + m.workspaces.in_use + m.exported.in_use;
    assert_eq!(own_device, sim.device_live().1 as u64, "{m}");
    assert_eq!(
        m.device.unwrap().pool_in_use,
        own_device,
        "the pool's figure: {m}"
    );
    assert_eq!(
        m.pinned.reserved + m.staging.reserved,
        sim.pinned_live().1 as u64,
        "{m}"
    );
    assert_eq!(m.registered.in_use, sim.registered_live().1 as u64, "{m}");
    let sum = |device: bool, f: fn(&Holding) -> u64| -> u64 {
        Owner::ALL
            .iter()
            .filter(|o| o.on_device() == device)
            .map(|&o| f(&m.of(o)))
            .sum()
    };
    assert_eq!(m.device_total.in_use, sum(true, |h| h.in_use));
    assert_eq!(m.device_total.count, sum(true, |h| h.count));
    assert_eq!(m.host_total.reserved, sum(false, |h| h.reserved));
    m
}

#[test]
fn tensors_pinned_buffers_and_their_peaks_are_counted_as_allocated() {
    let (mut engine, sim) = engine();
    let m = agrees(&mut engine, &sim);
    assert_eq!(m.device_total, Holding::default());
    assert_eq!(m.host_total, Holding::default());
    assert_eq!(m.nccl, None);

    let a = engine.alloc_tensor::<u32>(&[1000]).unwrap();
    let b = engine.alloc_tensor::<u8>(&[3, 5]).unwrap();
    let m = agrees(&mut engine, &sim);
    assert_eq!(
        (m.tensors.in_use, m.tensors.count, m.tensors.peak_in_use),
        (4015, 2, 4015)
    );
    assert_eq!(m.tensors.reserved, 4015);
    assert_eq!(m.device_total.in_use, 4015);
    drop(a);
    let m = agrees(&mut engine, &sim);
    assert_eq!((m.tensors.in_use, m.tensors.count), (15, 1));
    assert_eq!(m.tensors.peak_in_use, 4015, "the peak stays");
    engine.reset_peak_memory();
    assert_eq!(engine.memory().tensors.peak_in_use, 15);

    // A pinned buffer is a whole block of the pool's; dropped, it stays in the pool, idle.
    let pinned = PinnedHostBuffer::<u8>::new(&mut engine, 5000).unwrap();
    let m = agrees(&mut engine, &sim);
    assert_eq!(
        (m.pinned.in_use, m.pinned.reserved, m.pinned.count),
        (8192, 8192, 1)
    );
    drop(pinned);
    let m = agrees(&mut engine, &sim);
    assert_eq!(
        (m.pinned.in_use, m.pinned.reserved, m.pinned.count),
        (0, 8192, 0)
    );
    let again = PinnedHostBuffer::<u8>::new(&mut engine, 8000).unwrap();
    assert_eq!(agrees(&mut engine, &sim).pinned.in_use, 8192, "reused");
    drop(again);
    engine.set_pinned_pool_budget(0).unwrap();
    let m = agrees(&mut engine, &sim);
    assert_eq!((m.pinned.reserved, m.pinned.peak_reserved), (0, 8192));
    drop(b);
    let m = agrees(&mut engine, &sim);
    assert_eq!(m.device_total.in_use, 0);
    assert_eq!(m.host_total.in_use, 0);
}

#[test]
fn staged_pending_and_registered_routes_are_counted_and_retired_work_shows_until_proven() {
    let (mut engine, sim) = engine();
    // Staged: 40 MiB through the ring, with the copy threads the binary forces.
    let data = vec![3u8; 40 << 20];
    let tensor = upload_tensor(&mut engine, &data, &[data.len()]).unwrap();
    let m = agrees(&mut engine, &sim);
    let chunk = engine.staging_config().chunk_bytes as u64;
    assert_eq!(m.tensors.in_use, 40 << 20);
    assert_eq!(m.staging.in_use, 0, "every slot is back in the ring");
    assert!(
        m.staging.reserved >= chunk && m.staging.reserved.is_multiple_of(chunk),
        "{m}"
    );
    assert_eq!(m.staging.peak_in_use, m.staging.reserved);
    assert_eq!(download_tensor(&mut engine, &tensor).unwrap(), data);
    drop(tensor);
    // The idle slots and blocks go back on request; the peaks stay.
    engine.trim_host_memory().unwrap();
    let m = agrees(&mut engine, &sim);
    assert_eq!((m.staging.reserved, m.pinned.reserved), (0, 0));
    assert!(m.staging.peak_reserved >= chunk);

    // Pending: an upload dropped in flight is retired, holding its tensor and its buffer.
    sim.hold_clock(true);
    let buffer = PinnedHostBuffer::from_slice(&mut engine, &[7u8; 10_000]).unwrap();
    let target = engine.alloc_tensor::<u8>(&[10_000]).unwrap();
    drop(upload_pending(&mut engine, buffer, target).unwrap());
    let m = engine.memory();
    assert_eq!((m.retired.records, m.retired.bytes), (1, 10_000 + 12_288));
    assert_eq!(m.tensors.in_use, 10_000);
    assert_eq!(m.pinned.in_use, 12_288);
    sim.hold_clock(false);
    let m = agrees(&mut engine, &sim);
    assert_eq!((m.retired.records, m.retired.bytes), (0, 0));
    assert_eq!((m.tensors.in_use, m.pinned.in_use), (0, 0));

    // Registered: the elements, not the spare capacity; given back by `into_vec` or a drop.
    let mut vec = Vec::with_capacity(5000);
    vec.extend(0..3000u32);
    let registered = RegisteredBuffer::register(&mut engine, vec).unwrap();
    let m = agrees(&mut engine, &sim);
    assert_eq!((m.registered.in_use, m.registered.count), (12_000, 1));
    let vec = registered.into_vec().unwrap();
    assert_eq!(agrees(&mut engine, &sim).registered.in_use, 0);
    let registered = RegisteredBuffer::register(&mut engine, vec).unwrap();
    drop(registered);
    let m = agrees(&mut engine, &sim);
    assert_eq!((m.registered.in_use, m.registered.peak_in_use), (0, 12_000));
}

#[test]
fn library_workspaces_come_and_go_with_their_call() {
    let (mut engine, sim) = engine();
    let mut a = upload_tensor(&mut engine, &[4.0f32, 1.0, 1.0, 3.0], &[2, 2]).unwrap();
    let mut b = upload_tensor(&mut engine, &[1.0f32, 2.0], &[2, 1]).unwrap();
    let before = agrees(&mut engine, &sim);
    // The status holds the solver's verdict: a tensor of two `i32`s.
    let status = engine.cholesky_solve(&mut a, &mut b).unwrap();
    let m = agrees(&mut engine, &sim);
    assert_eq!((m.workspaces.in_use, m.workspaces.count), (0, 0));
    assert!(m.workspaces.peak_in_use > 0, "{m}");
    assert_eq!(m.tensors.in_use, before.tensors.in_use + 8);
    drop((a, b, status));
}

#[cfg(feature = "safetensors")]
#[test]
fn a_checkpoint_load_is_counted_packed_blocks_and_all() {
    use cuferry::checkpoint;
    use safetensors::Dtype;
    use safetensors::tensor::TensorView;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let big: Vec<u8> = (0..(1u32 << 20)).flat_map(|i| i.to_le_bytes()).collect();
    let small: Vec<Vec<u8>> = (0..20u8).map(|i| vec![i; 100 + usize::from(i)]).collect();
    let mut views = vec![(
        "big".to_owned(),
        TensorView::new(Dtype::U32, vec![1 << 20], &big).unwrap(),
    )];
    for (i, bytes) in small.iter().enumerate() {
        views.push((
            format!("small.{i}"),
            TensorView::new(Dtype::U8, vec![bytes.len()], bytes).unwrap(),
        ));
    }
    safetensors::serialize_to_file(
        views,
        None::<std::collections::HashMap<String, String>>,
        &path,
    )
    .unwrap();
    let (mut engine, sim) = engine();
    let loaded = checkpoint::load(&mut engine, &path).unwrap();
    let m = agrees(&mut engine, &sim);
    assert!(m.tensors.in_use >= (4 << 20) + small.iter().map(Vec::len).sum::<usize>() as u64);
    assert!(m.tensors.count < 21, "the small tensors share a block: {m}");
    assert_eq!(m.staging.in_use, 0);
    drop(loaded);
    let m = agrees(&mut engine, &sim);
    assert_eq!((m.tensors.in_use, m.tensors.count), (0, 0));
}

#[test]
fn after_the_teardown_nothing_is_held_and_a_watch_on_another_thread_saw_it_all() {
    let (mut engine, sim) = engine();
    let watch = engine.memory_watch();
    let data = vec![1u16; 3 << 20];
    let tensor = upload_tensor(&mut engine, &data, &[data.len()]).unwrap();
    let pinned = PinnedHostBuffer::<u8>::new(&mut engine, 1 << 20).unwrap();
    let seen = std::thread::spawn({
        let watch = watch.clone();
        move || watch.snapshot()
    })
    .join()
    .unwrap();
    assert_eq!(seen.tensors.in_use, 6 << 20);
    assert_eq!(seen.pinned.in_use, 1 << 20);
    assert!(seen.device.is_some());
    drop(engine);
    // Values outlive the engine: their memory is still counted until they go.
    assert_eq!(watch.held().tensors.in_use, 6 << 20);
    drop((tensor, pinned));
    let m = watch.held();
    for owner in Owner::ALL {
        let h = m.of(owner);
        assert_eq!((h.in_use, h.reserved, h.count), (0, 0, 0), "{owner}: {m}");
    }
    assert_eq!((m.device_total.in_use, m.host_total.reserved), (0, 0));
    assert_eq!(m.retired.records, 0);
    assert_eq!(m.tensors.peak_in_use, 6 << 20);
    assert!(m.staging.peak_reserved > 0);
    // The frees queued after the teardown run once the device gets to them.
    sim.advance_all();
    assert_eq!(sim.device_live().1, 0);
    assert_eq!(sim.pinned_live().1, 0);
}

#[test]
fn the_history_keeps_the_last_changes_with_their_callers_lines() {
    let (mut engine, _sim) = engine();
    engine.alloc_tensor::<u8>(&[1]).unwrap();
    assert!(engine.allocation_history().is_empty(), "off by default");
    engine.record_allocations(16);
    let line = line!() + 1;
    let tensor = engine.alloc_tensor::<u32>(&[10]).unwrap();
    let pinned_line = line!() + 1;
    let pinned = PinnedHostBuffer::<u8>::new(&mut engine, 100).unwrap();
    let registered_line = line!() + 1;
    let registered = RegisteredBuffer::register(&mut engine, vec![0u8; 64]).unwrap();
    let upload_line = line!() + 1;
    let uploaded = upload_tensor(&mut engine, &[1u8, 2], &[2]).unwrap();
    let history = engine.allocation_history();
    let here = |event: &cuferry::engine::AllocationEvent| {
        (
            event.location.file().ends_with("memory.rs"),
            event.location.line(),
        )
    };
    let allocated: Vec<_> = history
        .iter()
        .filter(|e| e.change == Change::Allocated)
        .map(|e| (e.owner, e.bytes, here(e)))
        .collect();
    assert!(
        allocated.contains(&(Owner::Tensors, 40, (true, line))),
        "{history:#?}"
    );
    assert!(allocated.contains(&(Owner::Pinned, 4096, (true, pinned_line))));
    assert!(allocated.contains(&(Owner::Registered, 64, (true, registered_line))));
    assert!(allocated.contains(&(Owner::Tensors, 2, (true, upload_line))));
    assert!(history.len() <= 16);
    let first = history[0].sequence;
    assert!(
        history
            .windows(2)
            .all(|w| w[1].sequence == w[0].sequence + 1)
    );
    drop(tensor);
    let last = engine.allocation_history().pop().unwrap();
    assert_eq!(
        (last.change, last.owner, last.bytes),
        (Change::Freed, Owner::Tensors, 40)
    );
    assert!(last.sequence > first);
    engine.record_allocations(0);
    assert!(engine.allocation_history().is_empty());
    drop((pinned, registered, uploaded));
}

#[test]
fn an_out_of_memory_error_carries_what_the_engine_holds_and_its_history() {
    let sim = SimDevice::new(SimConfig {
        memory_bytes: 1 << 20,
        ..SimConfig::default()
    });
    let mut engine = CudaEngine::simulated_on(&sim);
    engine.record_allocations(3);
    let held = engine.alloc_tensor::<u8>(&[600 << 10]).unwrap();
    let line = line!() + 1;
    let err = engine.alloc_tensor::<u8>(&[512 << 10]).unwrap_err();
    let text = err.to_string();
    let Error::OutOfMemory(oom) = err else {
        panic!("{err:?}")
    };
    assert_eq!(oom.asked, 512 << 10);
    assert_eq!(oom.held.tensors.in_use, 600 << 10);
    assert_eq!(oom.held.device.unwrap().pool_in_use, 600 << 10);
    assert_eq!(oom.history.len(), 1);
    assert_eq!(oom.history[0].bytes, 600 << 10);
    assert_eq!(oom.history[0].location.line(), line - 2);
    assert!(
        text.contains("; the engine's device memory: tensors 600.00 KiB\nthe engine's last 1 allocations and frees, oldest first:\n  #1 tensors allocated 600.00 KiB at "),
        "{text}"
    );
    drop(held);
}

/// A waker that resets a watch's peaks: refused with a typed error (the wake may run where the
/// engine's lock is held by a thread waiting for it), and nothing is reset; outside a wake it
/// resets.
#[test]
fn a_watch_refuses_to_reset_its_peaks_inside_a_wake() {
    use std::future::IntoFuture;
    use std::pin::Pin;
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Wake, Waker};

    struct ResetInWake {
        watch: cuferry::engine::MemoryWatch,
        result: Mutex<Option<Result<(), String>>>,
    }
    impl Wake for ResetInWake {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            let reset = self.watch.reset_peaks().map_err(|e| e.to_string());
            *self.result.lock().unwrap() = Some(reset);
        }
    }

    let (mut engine, _sim) = engine();
    let big = engine.alloc_tensor::<u8>(&[1 << 20]).unwrap();
    drop(big);
    let buffer = PinnedHostBuffer::from_slice(&mut engine, &[1u8; 64]).unwrap();
    let target = engine.alloc_tensor::<u8>(&[64]).unwrap();
    let mut future = upload_pending(&mut engine, buffer, target)
        .unwrap()
        .into_future();
    let hook = Arc::new(ResetInWake {
        watch: engine.memory_watch(),
        result: Mutex::new(None),
    });
    let waker = Waker::from(Arc::clone(&hook));
    // The simulator's clock is free: registering the wake runs the copy, and the wake comes
    // due inside this poll, on this thread, marked as the device's callback.
    let _ = Pin::new(&mut future).poll(&mut Context::from_waker(&waker));
    let refused = hook.result.lock().unwrap().take().expect("the wake ran");
    assert!(refused.unwrap_err().contains("inside a wake"));
    assert_eq!(engine.memory().tensors.peak_in_use, 1 << 20, "not reset");
    hook.watch.reset_peaks().unwrap();
    let m = engine.memory();
    assert_eq!(m.tensors.peak_in_use, m.tensors.in_use, "reset");
    assert!(m.tensors.in_use <= 64);
    drop(future);
}
