// Inside one scope a tensor is either read through `device_ptr` or written through
// `device_ptr_mut`, never both at once: raw work would otherwise read memory it also writes.
use cuferry::sim::SimConfig;
use cuferry::{upload_tensor, CudaEngine, Error};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut tensor = upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0], &[3]).unwrap();
    engine
        .with_raw(|raw| {
            let src = raw.device_ptr(&tensor)?;
            let dst = raw.device_ptr_mut(&mut tensor)?;
            // ... a raw copy from `src` to `dst` on raw.stream() ...
            Ok::<_, Error>((src.as_raw(), dst.as_raw()))
        })
        .unwrap();
}
