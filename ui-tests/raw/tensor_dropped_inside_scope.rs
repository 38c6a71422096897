// A tensor whose device pointer was taken stays borrowed until the scope ends: it cannot be
// dropped (its memory released) while raw work queued in the scope may still use the address.
use cuferry::sim::SimConfig;
use cuferry::{upload_tensor, CudaEngine, Error};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let tensor = upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0], &[3]).unwrap();
    engine
        .with_raw(move |raw| {
            let ptr = raw.device_ptr(&tensor)?;
            let address = ptr.as_raw();
            // ... a raw kernel reading `address` is queued on raw.stream() here ...
            drop(tensor);
            Ok::<_, Error>(address)
        })
        .unwrap();
}
