//! DLPack exchange: the bodies of `tests/bodies/dlpack.rs` on the simulated device, and the
//! orderings across the boundary under every interleaving of the streams, which only the
//! simulator's race checker sees.

use crate::bodies::dlpack::Claim;
use crate::support::{engines_on as engines, sim_machine as machine};
use cuferry::dlpack::{self, Ready, Stream, Strides, Version};
use cuferry::sim::Schedule;
use cuferry::{CudaEngine, download_tensor, upload_tensor};

crate::bodies::dlpack::tests!(sim);

fn stream_of(engine: &CudaEngine) -> Stream {
    // SAFETY: the engine's own compute stream, live while the engine is.
    unsafe { Stream::from_raw(dlpack::engine_stream(engine)) }
}

// Simulator-only: every interleaving of the streams under the race checker.
/// An export's consumer stream waits for the exporter's writes: a kernel of the consumer
/// engine, queued right after the import, reads what the exporter's upload and kernel wrote,
/// whatever order the streams run in.
#[test]
fn the_consumer_stream_waits_for_the_exporters_writes_under_every_interleaving() {
    for seed in 0..32 {
        let sim = machine(1);
        sim.set_schedule(Schedule::Interleaved { seed });
        let (mut a, mut b) = engines(&sim, 0, 0);
        let data: Vec<f32> = (0..4096).map(|i| i as f32).collect();
        let x = upload_tensor(&mut a, &data, &[4096]).unwrap();
        let y = a.scale(&x, 3.0).unwrap();
        let capsule = dlpack::export(&mut a, y, Some(stream_of(&b)), Version::V1).unwrap();
        let z =
            dlpack::import::<f32>(&mut b, capsule, Ready::OnEngineStream, Strides::Refuse).unwrap();
        let w = b.scale(&z, 2.0).unwrap();
        let expected: Vec<f32> = data.iter().map(|v| v * 6.0).collect();
        assert_eq!(
            download_tensor(&mut b, &w).unwrap(),
            expected,
            "seed {seed}"
        );
        drop((x, z, w));
        drop((a, b));
        // The export's free, queued by `b`'s teardown after `a`'s, runs when the device gets
        // to it.
        sim.advance_all();
        assert!(
            sim.violations().is_empty(),
            "seed {seed}: {:?}",
            sim.violations()
        );
        assert_eq!(sim.device_live().0, 0, "seed {seed}");
    }
}

// Simulator-only: as above.
/// The deleter of an export orders the free after the consumer's stream: a consumer that
/// queued a write of the memory and called the deleter at once (as a framework does when its
/// tensor dies with a kernel still queued) never has the memory freed under that write.
#[test]
fn an_exports_free_waits_for_the_consumers_stream_under_every_interleaving() {
    for seed in 0..32 {
        let sim = machine(1);
        sim.set_schedule(Schedule::Interleaved { seed });
        let (mut a, mut b) = engines(&sim, 0, 0);
        let x = upload_tensor(&mut a, &[1.0f32; 4096], &[4096]).unwrap();
        let capsule = dlpack::export(&mut a, x, Some(stream_of(&b)), Version::V1).unwrap();
        // The consumer: engine `b`'s stream, writing the memory through a view of its own.
        let dlpack::RawCapsule::Versioned(raw) = capsule.into_raw() else {
            unreachable!()
        };
        // SAFETY: the managed tensor just made, owned here until its deleter runs below.
        let data = unsafe { (*raw).dl_tensor.data } as u64;
        let (view, _) = Claim::f32(data, &[4096]).capsule();
        let mut v = dlpack::import::<f32>(
            &mut b,
            view.unwrap(),
            Ready::OnEngineStream,
            Strides::Refuse,
        )
        .unwrap();
        b.fill(&mut v, 5.0).unwrap();
        // The consumer lets go of the export while its write is queued.
        // SAFETY: the crate's own deleter, called once.
        unsafe { ((*raw).deleter.unwrap())(raw) };
        drop(v);
        b.synchronize().unwrap();
        drop((a, b));
        sim.advance_all();
        assert!(
            sim.violations().is_empty(),
            "seed {seed}: {:?}",
            sim.violations()
        );
        assert_eq!(sim.device_live().0, 0, "seed {seed}");
    }
}
