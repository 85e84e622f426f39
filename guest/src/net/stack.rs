//! smoltcp on the user-mode driver: the interface, its clock (the TSC), the loop step that
//! moves packets, and the counters every network task reports.

use core::fmt::Write;

use smoltcp::iface::{Config, Interface, PollResult, SocketSet, SocketStorage};
use smoltcp::time::Instant;
use smoltcp::wire::{EthernetAddress, IpCidr, Ipv4Address};

use super::driver::VirtioNet;
use super::Params;
use crate::abi;
use crate::ulib::{self, Line};

/// The longest a task sleeps without looking at its own clock again.
const MAX_IDLE_US: u64 = 100_000;
/// Time kept back before the task's deadline to print a result.
const DEADLINE_MARGIN_MS: u64 = 500;

pub struct Stack<'a> {
    pub iface: Interface,
    pub dev: VirtioNet,
    pub sockets: SocketSet<'a>,
    pub hz: u64,
    t0: u64,
    irqs0: u64,
}

impl<'a> Stack<'a> {
    pub fn new(mut dev: VirtioNet, p: &Params, storage: &'a mut [SocketStorage<'a>]) -> Self {
        let hz = ulib::tsc_hz().max(1);
        let t0 = ulib::rdtsc();
        let mut config = Config::new(EthernetAddress(dev.mac).into());
        config.random_seed = t0;
        let mut iface = Interface::new(config, &mut dev, Instant::from_micros(0));
        let [a, b, c, d] = p.ip;
        iface.update_ip_addrs(|addrs| {
            let _ = addrs.push(IpCidr::new(Ipv4Address::new(a, b, c, d).into(), p.prefix));
        });
        if p.has_gw {
            let [a, b, c, d] = p.gw;
            let _ = iface
                .routes_mut()
                .add_default_ipv4_route(Ipv4Address::new(a, b, c, d));
        }
        Stack {
            iface,
            dev,
            sockets: SocketSet::new(storage),
            hz,
            t0,
            irqs0: ulib::net_interrupts(),
        }
    }

    pub fn now(&self) -> Instant {
        let us = (ulib::rdtsc() - self.t0) as u128 * 1_000_000 / self.hz as u128;
        Instant::from_micros(us as i64)
    }

    pub fn us_since(&self, tsc: u64) -> u64 {
        self.us_of(ulib::rdtsc() - tsc)
    }

    /// `cycles` of the TSC in microseconds.
    pub fn us_of(&self, cycles: u64) -> u64 {
        (cycles as u128 * 1_000_000 / self.hz as u128) as u64
    }

    /// Moves every packet that can move now, then notifies the device once for the lot.
    /// True if anything happened that the task should look at.
    pub fn poll(&mut self) -> bool {
        let before = (self.dev.rx_packets(), self.dev.tx.packets);
        let now = self.now();
        let r = self.iface.poll(now, &mut self.dev, &mut self.sockets);
        self.dev.flush();
        r == PollResult::SocketStateChanged
            || before != (self.dev.rx_packets(), self.dev.tx.packets)
    }

    /// Waits for the device, for at most what smoltcp's timers and `max_us` allow.
    pub fn idle(&mut self, max_us: u64) {
        let now = self.now();
        let mut us = max_us.min(MAX_IDLE_US);
        if let Some(d) = self.iface.poll_delay(now, &self.sockets) {
            us = us.min(d.total_micros());
        }
        if us > 0 && !self.dev.ready() {
            self.dev.idle(us, self.hz);
        }
    }

    /// True once the task is close enough to its deadline that it must report now.
    pub fn out_of_time(&self) -> bool {
        let d = self.dev.deadline;
        d != 0 && ulib::rdtsc().saturating_add(DEADLINE_MARGIN_MS * self.hz / 1000) >= d
    }

    /// The driver's counters as JSON members (no leading comma).
    pub fn counters(&self, l: &mut Line) {
        let m = self.dev.mac;
        let _ = write!(
            l,
            "\"mac\":\"{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}\",\"mrg_rxbuf\":{},\"tx_packets\":{},\"rx_packets\":{},\"rx_dropped\":{},\"kicks\":{},\"waits\":{},\"interrupts\":{}",
            m[0],
            m[1],
            m[2],
            m[3],
            m[4],
            m[5],
            self.dev.rx.merged,
            self.dev.tx.packets,
            self.dev.rx_packets(),
            self.dev.rx.dropped + self.dev.other_pairs_rx().1,
            self.dev.kicks(),
            self.dev.waits,
            ulib::net_interrupts() - self.irqs0
        );
        let d = &self.dev;
        let _ = write!(
            l,
            ",\"spin_us\":{},\"wait_us\":{}",
            self.us_of(d.spin_cycles),
            self.us_of(d.wait_cycles)
        );
        let _ = write!(
            l,
            ",\"queue_pair\":{},\"queue_pairs\":{},\"max_queue_pairs\":{}",
            d.pair, d.pairs, d.max_pairs
        );
        // Frames the device was asked to cut and the segments it makes of them (null: the
        // device does not take them, or probe.net_tso=0).
        match &d.tx.tso {
            Some(t) => {
                let _ = write!(
                    l,
                    ",\"tso_frames\":{},\"tso_segments\":{}",
                    t.frames, t.segments
                );
            }
            None => {
                let _ = write!(l, ",\"tso_frames\":null,\"tso_segments\":null");
            }
        }
        let (other_pairs, other_dropped) = d.other_pairs_rx();
        if d.pairs > 1 && d.rx.only_port == 0 {
            let _ = write!(
                l,
                ",\"rx_other_pairs\":{},\"rx_other_pairs_dropped\":{}",
                other_pairs, other_dropped
            );
        }
        if d.rx.only_port != 0 {
            let _ = write!(l, ",\"rx_foreign\":{}", d.rx.foreign);
        }
        let ctrl_error = match d.ctrl {
            abi::NET_CTRL_ERR => "VQ_PAIRS_SET answered ERR",
            abi::NET_CTRL_NO_ANSWER => "VQ_PAIRS_SET got no answer",
            abi::NET_CTRL_UNUSABLE => "the control queue could not be set up",
            _ => "",
        };
        if !ctrl_error.is_empty() {
            let _ = write!(l, ",\"mq_error\":\"{}\"", ctrl_error);
        }
    }
}
