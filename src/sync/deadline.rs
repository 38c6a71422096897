//! One deadline for a whole exchange.
//!
//! Every wait on a peer, a file or the device that a caller bounds with a `Duration` turns that
//! duration into one [`Deadline`] at its start, and every read, accept and wait inside the
//! exchange asks the same deadline how long is left. A timeout therefore bounds a whole message
//! or handshake, however slowly a peer trickles it, never each read.
//!
//! `Instant + Duration` panics when the sum does not fit; a caller's `Duration::MAX` means "no
//! deadline", so the sum is checked here once and an unrepresentable instant is no deadline.

use std::time::{Duration, Instant};

/// The instant an exchange must end by, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadline(Option<Instant>);

impl Deadline {
    /// The deadline `within` from now; a `within` too large for an `Instant` (`Duration::MAX`
    /// among them) is no deadline.
    pub(crate) fn after(within: Duration) -> Deadline {
        Deadline::after_from(Instant::now(), within)
    }

    /// The deadline `within` after `start`; no deadline where the sum overflows.
    pub(crate) fn after_from(start: Instant, within: Duration) -> Deadline {
        Deadline(start.checked_add(within))
    }

    /// No deadline: waits until the exchange ends.
    #[allow(dead_code)] // Not every build uses every constructor.
    pub(crate) const fn never() -> Deadline {
        Deadline(None)
    }

    /// The instant, where there is one.
    #[allow(dead_code)]
    pub(crate) fn instant(self) -> Option<Instant> {
        self.0
    }

    /// The time left: `None` for no deadline, `Some(Duration::ZERO)` once it has passed.
    pub(crate) fn remaining(self) -> Option<Duration> {
        self.0
            .map(|at| at.saturating_duration_since(Instant::now()))
    }

    /// Whether the deadline has passed (never, for no deadline).
    pub(crate) fn expired(self) -> bool {
        self.0.is_some_and(|at| Instant::now() >= at)
    }

    /// The time left, capped at `cap` (for a socket timeout or a timed wait, which must be a
    /// finite, non-zero duration): `None` once the deadline has passed.
    pub(crate) fn slice(self, cap: Duration) -> Option<Duration> {
        match self.remaining() {
            None => Some(cap),
            Some(left) if left.is_zero() => None,
            Some(left) => Some(left.min(cap)),
        }
    }

    /// The earlier of this deadline and `other`.
    #[allow(dead_code)]
    pub(crate) fn min(self, other: Deadline) -> Deadline {
        match (self.0, other.0) {
            (Some(a), Some(b)) => Deadline(Some(a.min(b))),
            (a, b) => Deadline(a.or(b)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duration_max_is_no_deadline() {
        let d = Deadline::after(Duration::MAX);
        assert_eq!(d, Deadline::never());
        assert_eq!(d.remaining(), None);
        assert!(!d.expired());
        assert_eq!(
            d.slice(Duration::from_millis(5)),
            Some(Duration::from_millis(5))
        );
    }

    #[test]
    fn a_finite_deadline_runs_out() {
        let d = Deadline::after(Duration::ZERO);
        assert!(d.expired());
        assert_eq!(d.remaining(), Some(Duration::ZERO));
        assert_eq!(d.slice(Duration::from_secs(1)), None);
        let later = Deadline::after(Duration::from_secs(3600));
        assert!(!later.expired());
        assert!(later.slice(Duration::from_millis(5)).unwrap() <= Duration::from_millis(5));
        assert_eq!(later.min(d), d);
        assert_eq!(Deadline::never().min(d), d);
    }
}
