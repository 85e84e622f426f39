//! A VM and its RAM as the tests of both ends of a migration, and of replication, fake it.

use crate::protocol::RamLayout;
use crate::source::SourceVm;
use crate::VmFault;
use dsm::PAGE_SIZE;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

pub const RANGES: [(u64, u64); 2] = [(0, 64 * 4096), (0x100000, 32 * 4096)];

/// A paused-or-running VM of 96 pages, every third page holding data.
pub struct FakeVm {
    pub ram: Mutex<Vec<u8>>,
    pub captured: AtomicBool,
    /// Times the VM was paused and captured.
    pub captures: AtomicUsize,
    pub resumed: AtomicUsize,
    /// The VM ends here (a signal) as soon as it is captured.
    pub end_on_capture: bool,
    /// Dirty logging is on; gpas written since the last look.
    pub logging: AtomicBool,
    pub written: Mutex<Vec<u64>>,
    /// While it runs, the guest writes these pages again before each look at the log;
    /// when it pauses it writes `last`.
    pub busy_pages: Vec<u64>,
    pub last: Option<u64>,
    /// The VM has ended (the test says so).
    pub ended: AtomicBool,
    /// What replication did to the output gate, each with the captures taken by then.
    pub output: Mutex<Vec<(&'static str, usize)>>,
    /// Frames the guest sent since the last capture, each with its network device.
    pub sending: Mutex<Vec<(u32, Vec<u8>)>>,
    /// The frames the last capture sealed.
    pub sealed: Mutex<Vec<(u32, Vec<u8>)>>,
}

impl FakeVm {
    pub fn new() -> FakeVm {
        let mut ram = vec![0u8; 96 * 4096];
        for p in (0..96).step_by(3) {
            ram[p * 4096..(p + 1) * 4096].fill(p as u8 + 1);
        }
        FakeVm {
            ram: Mutex::new(ram),
            captured: AtomicBool::new(false),
            captures: AtomicUsize::new(0),
            resumed: AtomicUsize::new(0),
            end_on_capture: false,
            logging: AtomicBool::new(false),
            written: Mutex::new(Vec::new()),
            busy_pages: Vec::new(),
            last: None,
            ended: AtomicBool::new(false),
            output: Mutex::new(Vec::new()),
            sending: Mutex::new(Vec::new()),
            sealed: Mutex::new(Vec::new()),
        }
    }

    fn output_did(&self, what: &'static str) {
        let captures = self.captures.load(Ordering::SeqCst);
        self.output.lock().unwrap().push((what, captures));
    }
    pub fn layout() -> RamLayout {
        RamLayout::new(RANGES.to_vec()).unwrap()
    }
    /// The guest stores `value` over page `page`.
    pub fn write(&self, page: u64, value: u8) {
        let o = page as usize * 4096;
        self.ram.lock().unwrap()[o..o + 4096].fill(value);
        if self.logging.load(Ordering::SeqCst) {
            let gpa = Self::layout().gpa_of(page).unwrap();
            self.written.lock().unwrap().push(gpa);
        }
    }
}

impl SourceVm for FakeVm {
    fn config(&self) -> Vec<u8> {
        b"the config".to_vec()
    }
    fn capture(&self) -> Result<Vec<u8>, VmFault> {
        if let Some(p) = self.last {
            self.write(p, 0xee);
        }
        self.captured.store(true, Ordering::SeqCst);
        *self.sealed.lock().unwrap() = std::mem::take(&mut *self.sending.lock().unwrap());
        self.captures.fetch_add(1, Ordering::SeqCst);
        Ok(vec![b's'; 40_000])
    }
    fn hold_output(&self) {
        self.output_did("hold");
    }
    fn captured_output(&self) -> crate::protocol::Frames {
        self.sealed.lock().unwrap().clone()
    }
    fn release_output(&self) {
        self.output_did("release");
    }
    fn open_output(&self) {
        self.output_did("open");
    }
    fn resume(&self) -> Result<(), VmFault> {
        self.resumed.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn ram_ranges(&self) -> Vec<(u64, u64)> {
        RANGES.to_vec()
    }
    fn pages_with_data(&self) -> Result<Vec<u64>, VmFault> {
        let l = Self::layout();
        Ok((0..96).step_by(3).map(|p| l.gpa_of(p).unwrap()).collect())
    }
    fn read_page(&self, gpa: u64, buf: &mut [u8; PAGE_SIZE]) -> Result<(), VmFault> {
        let o = Self::layout().page_of(gpa).unwrap() as usize * 4096;
        buf.copy_from_slice(&self.ram.lock().unwrap()[o..o + 4096]);
        Ok(())
    }
    fn has_ended(&self) -> bool {
        self.ended.load(Ordering::SeqCst)
            || self.end_on_capture && self.captured.load(Ordering::SeqCst)
    }
    fn start_dirty_log(&self) -> Result<(), VmFault> {
        self.logging.store(true, Ordering::SeqCst);
        Ok(())
    }
    fn dirty_pages(&self) -> Result<Vec<u64>, VmFault> {
        if !self.logging.load(Ordering::SeqCst) {
            return Err("dirty logging is off".into());
        }
        if !self.captured.load(Ordering::SeqCst) {
            for &p in &self.busy_pages {
                let next = self.ram.lock().unwrap()[p as usize * 4096].wrapping_add(1);
                self.write(p, next);
            }
        }
        Ok(std::mem::take(&mut *self.written.lock().unwrap()))
    }
    fn stop_dirty_log(&self) -> Result<(), VmFault> {
        self.logging.store(false, Ordering::SeqCst);
        Ok(())
    }
}
