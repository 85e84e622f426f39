//! virtio over MMIO: the transport and the devices behind it.
