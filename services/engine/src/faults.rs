//! Fault injection for tests of the engine's supervision and of atomic reloads (feature
//! `fault-injection`, enabled only by test crates). Without the feature the hooks compile to
//! nothing.

#[cfg(feature = "fault-injection")]
mod imp {
    use std::sync::atomic::{AtomicU32, Ordering};

    static PANIC_STEPS: AtomicU32 = AtomicU32::new(0);
    static FAIL_RECONFIGURE: AtomicU32 = AtomicU32::new(0);

    /// Make the next `n` reloads fail after their weights were swapped in (when the monitor
    /// is reconfigured), to test that the swap is rolled back.
    pub fn fail_next_reconfigures(n: u32) {
        FAIL_RECONFIGURE.store(n, Ordering::SeqCst);
    }

    pub(crate) fn before_reconfigure() -> crate::error::Result<()> {
        let armed = FAIL_RECONFIGURE
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        match armed {
            true => Err(crate::error::EngineError::Config(
                "injected reconfigure failure (fault-injection)".into(),
            )),
            false => Ok(()),
        }
    }

    /// Make the next `n` steps of every engine in this process panic inside the executor.
    pub fn panic_next_steps(n: u32) {
        PANIC_STEPS.store(n, Ordering::SeqCst);
    }

    pub(crate) fn before_step() {
        let armed = PANIC_STEPS
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if armed {
            panic!("injected step panic (fault-injection)");
        }
    }
}

#[cfg(feature = "fault-injection")]
pub use imp::{fail_next_reconfigures, panic_next_steps};

#[cfg(feature = "fault-injection")]
pub(crate) use imp::{before_reconfigure, before_step};

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn before_step() {}

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn before_reconfigure() -> crate::error::Result<()> {
    Ok(())
}
