// The user guide: the Markdown chapters of `docs/guide/`, rendered as documentation and run as
// doctests, so every snippet in the guide compiles and runs against the current API.
#![doc = include_str!("../docs/guide/README.md")]

pub mod engine {
    // Opening an engine, ownership, Drop rules and the simulated device.
    #![doc = include_str!("../docs/guide/engine.md")]
}

pub mod flush_and_synchronize {
    // The submission boundary, the host barrier and every place the host waits.
    #![doc = include_str!("../docs/guide/flush-and-synchronize.md")]
}

pub mod transfers {
    // The blocking and pending routes, pinned buffers, staging settings and which route to use.
    #![doc = include_str!("../docs/guide/transfers.md")]
}

#[cfg(feature = "safetensors")]
pub mod checkpoints {
    // Loading and saving safetensors checkpoints through pinned staging.
    #![doc = include_str!("../docs/guide/checkpoints.md")]
}

pub mod across_processes {
    // Ranks in processes of their own: launch, rendezvous, join, collectives, deadlines, and
    // what happens when a peer dies.
    #![doc = include_str!("../docs/guide/across-processes.md")]
}

#[cfg(target_os = "linux")]
pub mod sharing {
    // Device tensors shared between processes: the mechanism, the two sides, the order across
    // processes, the lifetimes, and what is refused.
    #![doc = include_str!("../docs/guide/sharing.md")]
}

pub mod kernels {
    // The elementwise kernels: which element types each serves, and their semantics.
    #![doc = include_str!("../docs/guide/kernels.md")]
}

pub mod api {
    // The rule every public item follows, the modules, and what moved since 0.1.
    #![doc = include_str!("../docs/guide/api.md")]
}

pub mod prepared_graphs {
    // Tracing, compiling, preparing and running programs; borrowed outputs and the rules.
    #![doc = include_str!("../docs/guide/prepared-graphs.md")]
}

pub mod lifecycles {
    // The lifecycle types and the misuse they rule out, as compile-fail doctests.
    #![doc = include_str!("../docs/guide/lifecycles.md")]
}

pub mod rules {
    // The invariants every operation keeps.
    #![doc = include_str!("../docs/guide/rules.md")]
}

pub mod unsupported {
    // What is refused, and the typed error each refusal returns.
    #![doc = include_str!("../docs/guide/unsupported.md")]
}
