//! The multi-process example's ranks (`examples/multi_process.rs`) on a simulated machine, one
//! thread per rank with the launcher's variables: every result checked for worlds of one to
//! four, and a rank that fails ending its peers by their deadline with a typed error.

#[allow(dead_code)]
#[path = "../../examples/multi_process.rs"]
mod example;

use cuferry::Error;
use cuferry::error::PeerError;
use std::time::Duration;

#[test]
fn every_rank_of_the_example_checks_its_results() {
    for world in 1..=4 {
        let outcomes =
            example::launch_simulated(world, 1000, Duration::from_secs(60), None).unwrap();
        assert_eq!(outcomes.len(), world);
        for (rank, outcome) in outcomes.into_iter().enumerate() {
            let report = outcome.unwrap_or_else(|e| panic!("world {world}, rank {rank}: {e}"));
            assert_eq!((report.rank, report.world), (rank, world));
        }
    }
}

#[test]
fn a_rank_that_fails_ends_its_peers_by_their_deadline() {
    let deadline = Duration::from_millis(300);
    let outcomes = example::launch_simulated(3, 1000, deadline, Some(1)).unwrap();
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        let error = outcome
            .err()
            .unwrap_or_else(|| panic!("rank {rank} completed"));
        if rank == 1 {
            assert!(
                error.to_string().contains("as --fail-rank asked"),
                "{error}"
            );
        } else {
            assert!(
                matches!(
                    error.downcast_ref::<Error>(),
                    Some(Error::Peer(PeerError::CollectiveTimedOut { .. }))
                ),
                "rank {rank}: {error}"
            );
        }
    }
}

#[test]
fn the_example_with_no_deadline_completes() {
    // `Duration::MAX` is "no deadline" for the rendezvous, the join and every collective.
    let outcomes = example::launch_simulated(2, 1000, Duration::MAX, None).unwrap();
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        let report = outcome.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!((report.rank, report.world), (rank, 2));
    }
}
