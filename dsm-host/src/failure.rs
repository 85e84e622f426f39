//! Where a thread serving guest RAM reports the failure that ends its VM: the owner says how
//! to end the VM only once the VM is built, and a failure may come first.

use std::sync::Mutex;

/// What to do when the VM cannot go on: it lacks a page it will never get.
pub type FailureHook = Box<dyn Fn(String) + Send + Sync>;

#[derive(Default)]
struct Slot {
    hook: Option<FailureHook>,
    /// A failure reported before the hook was set.
    early: Option<String>,
}

/// A failure hook set once, and failures reported to it; one that comes before the hook
/// is kept and handed over when the hook is set. Both sides take the one lock, so no
/// failure falls between them.
#[derive(Default)]
pub struct FailureSlot(Mutex<Slot>);

impl FailureSlot {
    /// Sets the hook (a second one is ignored) and hands it a failure that came before.
    pub fn set(&self, hook: FailureHook) {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(why) = s.early.take() {
            hook(why);
        }
        s.hook.get_or_insert(hook);
    }

    /// Reports `why` to the hook, or keeps it for the hook to come (the first one kept).
    pub fn fail(&self, why: String) {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match &s.hook {
            Some(hook) => hook(why),
            None => {
                s.early.get_or_insert(why);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_failure_before_the_hook_is_handed_over_when_it_is_set() {
        let slot = FailureSlot::default();
        slot.fail("page 0x12 unreadable".into());
        slot.fail("a later one".into());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        slot.set(Box::new(move |why| s.lock().unwrap().push(why)));
        slot.fail("after".into());
        assert_eq!(*seen.lock().unwrap(), ["page 0x12 unreadable", "after"]);
    }
}
