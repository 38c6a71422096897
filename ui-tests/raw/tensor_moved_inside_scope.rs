// A tensor whose device pointer was taken stays borrowed until the scope ends: it cannot be
// replaced (the old one dropped) while raw work queued in the scope may still use the address.
use cuferry::sim::SimConfig;
use cuferry::{upload_tensor, CudaEngine, Error};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut tensor = upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0], &[3]).unwrap();
    let mut other = Some(upload_tensor(&mut engine, &[4.0f32, 5.0, 6.0], &[3]).unwrap());
    engine
        .with_raw(|raw| {
            let ptr = raw.device_ptr_mut(&mut tensor)?;
            let address = ptr.as_raw();
            // ... a raw kernel writing `address` is queued on raw.stream() here ...
            let old = std::mem::replace(&mut tensor, other.take().unwrap());
            drop(old);
            Ok::<_, Error>(address)
        })
        .unwrap();
}
