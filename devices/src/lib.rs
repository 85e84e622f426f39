//! Emulated devices of a Musubi VM.
//!
//! Devices know nothing of KVM: they see guest memory through `vm-memory`, raise interrupts
//! through [`Irq`], and are reached through the `vm-device` bus traits, so each can be tested
//! with mock memory and a counting interrupt line.

#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod irq;
pub mod legacy;
pub mod net;
pub mod virtio;

pub use irq::{EventFdIrq, Irq};

/// Guest memory as the VMM and its devices see it. Every write made through it (a used ring,
/// a received frame, a block read) marks its pages in the region's bitmap: KVM's dirty log
/// sees only the guest's own writes, and a live migration must resend the VMM's too.
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<vm_memory::bitmap::AtomicBitmap>;
/// One region of [`GuestMemoryMmap`].
pub type GuestRegionMmap = vm_memory::GuestRegionMmap<vm_memory::bitmap::AtomicBitmap>;
/// The host mapping behind a [`GuestRegionMmap`].
pub type MmapRegion = vm_memory::MmapRegion<vm_memory::bitmap::AtomicBitmap>;

/// How the VM ends when a device asks it to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndRequest {
    /// The guest wrote its exit status to the exit port.
    Status(u8),
    /// The guest reset the machine (i8042 reset line): treated as a clean shutdown.
    Reset,
    /// The guest put the machine into S5 (ACPI soft off): a clean shutdown.
    PowerOff,
}

/// Receives the guest's request to end the VM; implemented by the VMM's run control.
pub trait EndSink: Send + Sync {
    fn request_end(&self, request: EndRequest);
}
