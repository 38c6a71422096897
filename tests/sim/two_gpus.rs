//! The two-GPU example's pipeline (`examples/two_gpus.rs`) on a simulated machine of two devices,
//! under interleaved streams: every batch's result is right, the host waits once (the program
//! checks every other transfer complete without waiting), and nothing runs out of order or leaks.

#[allow(dead_code)]
#[path = "../../examples/two_gpus.rs"]
mod example;

use cuferry::CudaEngine;
use cuferry::sim::{Schedule, SimConfig, SimDevice};

#[test]
fn the_pipeline_delivers_every_batch_with_one_host_wait() {
    for seed in 0..8 {
        let machine = SimDevice::new(SimConfig {
            devices: 2,
            ..SimConfig::default()
        });
        machine.set_schedule(Schedule::Interleaved { seed });
        let gpu0 = CudaEngine::simulated_on_device(&machine, 0).unwrap();
        let gpu1 = CudaEngine::simulated_on_device(&machine, 1).unwrap();
        let report = example::pipeline(gpu0, gpu1, 6, 1000).unwrap();
        assert_eq!(report.results.len(), 6);
        for (k, got) in report.results.iter().enumerate() {
            let want: Vec<f32> = (0..1000).map(|i| 6.0 * (k + i % 1000) as f32).collect();
            assert_eq!(got, &want, "seed {seed}, batch {k}");
        }
        machine.advance_all();
        assert!(
            machine.violations().is_empty(),
            "{:?}",
            machine.violations()
        );
        assert_eq!(
            machine.device_live().0,
            0,
            "seed {seed}: device memory left"
        );
    }
}
