//! The engine's parts: the state that the levels above the core keep per engine, held behind
//! the engine's lock without the core naming it.
//!
//! Some subsystems keep state per engine that changes together with the driver and so lives
//! behind the engine's lock: the memory level's pinned pool and staging ring, the work level's
//! kernel cache, for example. Each such state is a [`Part`], a type defined, made and used in its
//! own module. The engine's state holds them in one [`Parts`], by type: a module asks for its
//! part ([`Parts::get_mut`]), which is made (empty, by `Default`) the first time an engine needs
//! it, and the engine's teardown releases every part it made at the place the part names
//! ([`Teardown`]). The core knows the trait and never the types, so nothing in the core names a
//! level above it, and a subsystem that touches another's state names that state's type, where
//! `tests/levels.rs` sees it.
//!
//! A lookup scans the few parts an engine has made (one per type, a handful at most) for a type
//! id and downcasts the one found, a few nanoseconds: it never hashes and, after a part's first
//! use, never allocates.

use crate::driver::Driver;
use crate::ledger::Ledger;
use std::any::{Any, TypeId};

/// State that a level above the core keeps per engine, behind the engine's lock.
///
/// A part is made empty (`Default`) the first time its engine asks for it, lives as long as the
/// engine's shared state, and is released once, by [`teardown`](Part::teardown), when the engine
/// is dropped.
pub(crate) trait Part: Any + Send + Default {
    /// Where the engine's teardown releases this part: before or after the core's own events,
    /// and in which order among the parts of the same stage. No two parts share a place.
    const TEARDOWN: Teardown;

    /// Releases what the part holds of the driver's (memory, modules, handles). Called once, at
    /// the engine's teardown, with the engine's context current, and only after a wait has
    /// proven the streams idle (nothing queued before it is still pending) and the retirement
    /// queue has been settled; when that wait fails it is never called, and what the part holds
    /// is leaked. Never reports: a refused release leaves the resource with the driver. What it
    /// gives back of memory the engine accounts for, it tells `ledger`.
    fn teardown(&mut self, driver: &mut dyn Driver, ledger: &mut Ledger);
}

/// A part's place in the engine's teardown, which, once the streams are proven idle and the
/// retirement queue settled, releases the parts of [`BeforeEvents`](Teardown::BeforeEvents),
/// then the core's own events (the event pool's and the lane order's), then the parts of
/// [`AfterEvents`](Teardown::AfterEvents). Within a stage, parts go in ascending order of the
/// number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Teardown {
    /// Before the core's events.
    BeforeEvents(u8),
    /// After the core's events.
    AfterEvents(u8),
}

/// One part an engine has made.
struct Slot {
    /// The part's type.
    id: TypeId,
    /// Its place in the teardown.
    teardown: Teardown,
    /// The part, of type `id`.
    part: Box<dyn Any + Send>,
    /// Its [`Part::teardown`].
    release: fn(&mut (dyn Any + Send), &mut dyn Driver, &mut Ledger),
}

/// The parts an engine has made, one per type, in the order of their teardown.
#[derive(Default)]
pub(crate) struct Parts {
    slots: Vec<Slot>,
}

/// [`Part::teardown`] of a part held as `dyn Any`.
fn release<P: Part>(part: &mut (dyn Any + Send), driver: &mut dyn Driver, ledger: &mut Ledger) {
    if let Some(part) = part.downcast_mut::<P>() {
        part.teardown(driver, ledger);
    }
}

impl Parts {
    /// The engine's part of type `P`, made on first use.
    #[inline]
    pub(crate) fn get_mut<P: Part>(&mut self) -> &mut P {
        let id = TypeId::of::<P>();
        let at = match self.slots.iter().position(|slot| slot.id == id) {
            Some(at) => at,
            None => self.insert::<P>(),
        };
        self.slots[at]
            .part
            .downcast_mut()
            .expect("a part's slot holds a part of its type")
    }

    /// The engine's part of type `P`, if it has been made.
    #[inline]
    pub(crate) fn get<P: Part>(&self) -> Option<&P> {
        let id = TypeId::of::<P>();
        self.slots
            .iter()
            .find(|slot| slot.id == id)?
            .part
            .downcast_ref()
    }

    /// Makes the part of type `P` (there is none yet) and returns its index, keeping the parts
    /// in the order of their teardown.
    #[cold]
    #[inline(never)]
    fn insert<P: Part>(&mut self) -> usize {
        let at = self
            .slots
            .partition_point(|slot| slot.teardown < P::TEARDOWN);
        debug_assert!(
            self.slots
                .get(at)
                .is_none_or(|slot| slot.teardown != P::TEARDOWN),
            "two parts share the teardown place {:?}",
            P::TEARDOWN
        );
        self.slots.insert(
            at,
            Slot {
                id: TypeId::of::<P>(),
                teardown: P::TEARDOWN,
                part: Box::new(P::default()),
                release: release::<P>,
            },
        );
        at
    }

    /// Releases the parts of [`Teardown::BeforeEvents`], in order ([`Part::teardown`]).
    pub(crate) fn teardown_before_events(&mut self, driver: &mut dyn Driver, ledger: &mut Ledger) {
        self.teardown_where(driver, ledger, |place| {
            matches!(place, Teardown::BeforeEvents(_))
        });
    }

    /// Releases the parts of [`Teardown::AfterEvents`], in order ([`Part::teardown`]).
    pub(crate) fn teardown_after_events(&mut self, driver: &mut dyn Driver, ledger: &mut Ledger) {
        self.teardown_where(driver, ledger, |place| {
            matches!(place, Teardown::AfterEvents(_))
        });
    }

    /// Releases the parts whose place `stage` accepts, in the order of their teardown.
    fn teardown_where(
        &mut self,
        driver: &mut dyn Driver,
        ledger: &mut Ledger,
        stage: impl Fn(Teardown) -> bool,
    ) {
        for slot in self.slots.iter_mut().filter(|slot| stage(slot.teardown)) {
            (slot.release)(&mut *slot.part, driver, ledger);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::sim::{SimConfig, SimDevice, SimDriver};
    use std::cell::RefCell;

    thread_local! {
        /// The parts torn down on this thread, in order.
        static TORN_DOWN: RefCell<Vec<&'static str>> = const { RefCell::new(Vec::new()) };
    }

    fn torn_down() -> Vec<&'static str> {
        TORN_DOWN.with(|log| log.borrow().clone())
    }

    macro_rules! part {
        ($name:ident, $place:expr_2021) => {
            #[derive(Default)]
            struct $name(u32);
            impl Part for $name {
                const TEARDOWN: Teardown = $place;
                fn teardown(&mut self, _driver: &mut dyn Driver, _ledger: &mut Ledger) {
                    TORN_DOWN.with(|log| log.borrow_mut().push(stringify!($name)));
                }
            }
        };
    }

    part!(Late1, Teardown::AfterEvents(1));
    part!(Early0, Teardown::BeforeEvents(0));
    part!(Late0, Teardown::AfterEvents(0));
    part!(Early1, Teardown::BeforeEvents(1));

    #[test]
    fn parts_are_made_once_by_type_and_torn_down_by_place() {
        let mut parts = Parts::default();
        assert!(parts.get::<Late1>().is_none());
        // Made in an order unlike their teardown's.
        parts.get_mut::<Late1>().0 = 1;
        parts.get_mut::<Early1>().0 = 2;
        parts.get_mut::<Late0>().0 = 3;
        parts.get_mut::<Early0>().0 = 4;
        parts.get_mut::<Late1>().0 += 10;
        assert_eq!(parts.get::<Late1>().map(|p| p.0), Some(11));
        assert_eq!(parts.get::<Early1>().map(|p| p.0), Some(2));
        assert_eq!(parts.get::<Late0>().map(|p| p.0), Some(3));
        assert_eq!(parts.get::<Early0>().map(|p| p.0), Some(4));
        assert_eq!(parts.slots.len(), 4);
        let mut driver = SimDriver::new(SimDevice::new(SimConfig::default()));
        parts.teardown_before_events(&mut driver, &mut Ledger::default());
        assert_eq!(torn_down(), ["Early0", "Early1"]);
        parts.teardown_after_events(&mut driver, &mut Ledger::default());
        assert_eq!(torn_down(), ["Early0", "Early1", "Late0", "Late1"]);
    }
}
