//! The consumer side of the WAN link, sans-IO (public so that a driver of another
//! transport runs the same rules): what to do when a relay's connection epoch
//! ends, when a pool stream ends, when a side stream (load, topology) is lost, and how
//! long to wait before trying again. The tokio client (`client.rs`) only moves bytes and
//! runs these decisions with its clock's `now` and a jitter sample, so every rule here is
//! tested on a simulated clock.
//!
//! - A relay whose connection merely broke keeps its catalog and suspended replicas for
//!   [`Limits::resume_hold`](crate::Limits::resume_hold), so its next epoch can resume
//!   them; a relay that restarted, broke the catalog rules or speaks another major version
//!   starts over at once, and so does one held past the resume hold.
//! - One pool stream's rules (what a message means, staleness, the snapshot's assembly
//!   deadline, what becomes of the replica, when to subscribe again) are in [`pool`]: a
//!   stream that broke in transit (disconnected, cut off for lag, stale) leaves an intact
//!   replica, suspended for resuming; anything else invalidates it.
//! - Every retry waits on a [`Backoff`] that resets only after an attempt stayed healthy,
//!   never for reaching current (a relay that breaks every stream after its snapshot must
//!   not get a snapshot per base delay). The one exception is rejoining a relay that went
//!   away ([`RelayLink::with_rejoin`]): attempts that reach no relay are retried at a short
//!   fixed interval for a while, so a restarted relay is followed again at once.

use std::time::{Duration, Instant};

use kvrelay_pacing::{Backoff, BackoffConfig, equal_jitter};

pub mod epoch;
pub mod pool;

/// What becomes of a relay's view (catalog, replicas) when its epoch ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ViewAfterEpoch {
    /// Drop everything kept from this relay: the next epoch starts from scratch.
    StartOver,
    /// Keep the view, suspended (not scored), for the next epoch to resume.
    Suspend,
}

/// How a relay's connection epoch ended, as far as the view is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EpochEnd {
    /// The relay restarted, broke the catalog rules or speaks another major version:
    /// nothing kept is valid any more.
    Invalidated,
    /// The connection broke (or the relay went quiet): what is kept may still resume.
    Broken,
}

/// How far an epoch's attempt got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// The relay answered (its relay info): the epoch was followed.
    Answered,
    /// No relay was reached: the connection was refused, timed out or broke before any
    /// answer. Retrying costs the relay nothing.
    Unreachable,
    /// A relay was reached but did not answer: a failed TLS handshake, a refusal (a wrong
    /// token, an admission limit), a closed or malformed first answer.
    Declined,
}

/// One DC's link: its reconnect backoff, how long its view has been suspended, and which
/// of the DC's relays (a pair, or more) it follows.
///
/// Failover: when the followed relay's epoch ends, the link moves to the next address. A
/// relay that was connected and broke is replaced at once, and each other address is tried
/// once at once after it; only when every address failed in a row does the backoff apply.
/// The link stays on whichever relay works (it never moves back by itself), so two healthy
/// relays never flap.
#[derive(Debug, Clone)]
pub struct RelayLink {
    backoff: Backoff,
    resume_hold: Duration,
    suspended_since: Option<Instant>,
    /// The DC's relay addresses (1 without a pair).
    addresses: usize,
    /// The one followed now.
    active: usize,
    /// Addresses to try without waiting before the backoff applies.
    untried: usize,
    /// No second move for silence or a stalled pool within this long of the last one.
    failover_hold: Duration,
    /// When the link last left a relay for silence or a stalled pool.
    held_since: Option<Instant>,
    /// Retries of a relay that was followed and went away: see [`RelayLink::with_rejoin`].
    rejoin_interval: Duration,
    rejoin_window: Duration,
    /// When a followed relay's connection last broke (the rejoin window's start).
    broken_at: Option<Instant>,
}

impl RelayLink {
    /// A link to a DC's `addresses` relays (1 without a pair): retries on `backoff`, keeps
    /// a broken epoch's view for `resume_hold` and moves for silence or a stalled pool at
    /// most once per `failover_hold`.
    pub fn new(
        backoff: BackoffConfig,
        resume_hold: Duration,
        failover_hold: Duration,
        addresses: usize,
    ) -> Self {
        let addresses = addresses.max(1);
        Self {
            backoff: Backoff::new(backoff),
            resume_hold,
            suspended_since: None,
            addresses,
            active: 0,
            untried: addresses - 1,
            failover_hold,
            held_since: None,
            rejoin_interval: Duration::ZERO,
            rejoin_window: Duration::ZERO,
            broken_at: None,
        }
    }

    /// After a followed relay's connection broke, attempts that cannot reach any relay
    /// (refused, timed out) are retried every `interval` (half of it jitter) for `window`
    /// from the break, instead of on the growing backoff: a relay that restarts is back
    /// within a second or two, and the backoff's doubling would otherwise land the
    /// reconnect a whole step after it (0.5, 1.5, 3.5 s). Such attempts cost the relay
    /// nothing (its port refuses them); one that reaches a relay and fails there waits on
    /// the backoff as before, so a relay that breaks every stream is never hammered. A zero
    /// window (the default here) turns it off.
    pub fn with_rejoin(mut self, interval: Duration, window: Duration) -> Self {
        self.rejoin_interval = interval;
        self.rejoin_window = window;
        self
    }

    /// The rejoin delay for an attempt that reached no relay at `now`, if the window of the
    /// last break is still open.
    fn rejoin_delay(&self, now: Instant, jitter: f64) -> Option<Duration> {
        let open = self
            .broken_at
            .is_some_and(|at| now.saturating_duration_since(at) < self.rejoin_window);
        (open && !self.rejoin_interval.is_zero())
            .then(|| equal_jitter(self.rejoin_interval, jitter))
    }

    /// The followed relay's catalog named `stalled` pools at `now`: whether to leave it
    /// for the DC's next relay (the epoch then ends, and [`RelayLink::handle_epoch_end`]
    /// moves on at once). Only when some pool is stalled, and see
    /// [`RelayLink::handle_silent`].
    pub fn handle_stalled(&mut self, now: Instant, stalled: usize) -> bool {
        stalled > 0 && self.may_leave(now)
    }

    /// The followed relay went silent at `now` ([`SilenceWatch`]): whether to leave it.
    /// Only with another address to go to, and not within the failover hold of the last
    /// move for silence or a stall, so two relays that are both late or stalled never
    /// bounce the consumer (and a snapshot of every pool) between them.
    pub fn handle_silent(&mut self, now: Instant) -> bool {
        self.may_leave(now)
    }

    fn may_leave(&mut self, now: Instant) -> bool {
        let held = self
            .held_since
            .is_some_and(|at| now.saturating_duration_since(at) < self.failover_hold);
        if self.addresses < 2 || held {
            return false;
        }
        self.held_since = Some(now);
        true
    }

    /// The address (index into the DC's addresses) the next epoch connects to.
    pub fn active(&self) -> usize {
        self.active
    }

    /// Before an epoch opens at `now`: whether the suspended view was held past the
    /// resume hold and must start over.
    pub fn handle_epoch_start(&mut self, now: Instant) -> Option<ViewAfterEpoch> {
        let expired = self
            .suspended_since
            .is_some_and(|since| now.saturating_duration_since(since) > self.resume_hold);
        if expired {
            self.suspended_since = None;
            return Some(ViewAfterEpoch::StartOver);
        }
        None
    }

    /// An epoch that started `healthy_for` before `now` ended as `end`, having got as far
    /// as `reach`: what becomes of the view, and how long to wait
    /// before the next epoch (`jitter` in `[0, 1]`), which goes to [`RelayLink::active`].
    pub fn handle_epoch_end(
        &mut self,
        now: Instant,
        end: EpochEnd,
        healthy_for: Duration,
        reach: Reach,
        jitter: f64,
    ) -> (ViewAfterEpoch, Duration) {
        let view = match end {
            EpochEnd::Invalidated => {
                self.suspended_since = None;
                ViewAfterEpoch::StartOver
            }
            EpochEnd::Broken => {
                // The hold runs from the first break, not from each failed reconnect.
                self.suspended_since.get_or_insert(now);
                ViewAfterEpoch::Suspend
            }
        };
        let connected = reach == Reach::Answered;
        if connected {
            self.broken_at = (end == EpochEnd::Broken).then_some(now);
        }
        let delay = match self.rejoin_delay(now, jitter) {
            Some(delay) if reach == Reach::Unreachable => delay,
            _ => self.backoff.on_failure(healthy_for, jitter),
        };
        if self.addresses > 1 {
            if connected {
                self.untried = self.addresses - 1;
            }
            self.active = (self.active + 1) % self.addresses;
            if self.untried > 0 {
                self.untried -= 1;
                return (view, Duration::ZERO);
            }
        }
        (view, delay)
    }
}

/// When to check that a DC's other relays (a pair's standby) would answer if the followed
/// one failed: every `interval`, half of it jitter (so consumers do not probe in step). A
/// standby that died is then known before it is needed, not at the failover.
#[derive(Debug, Clone)]
pub struct StandbyProbe {
    interval: Duration,
    next_at: Option<Instant>,
}

impl StandbyProbe {
    /// The schedule of a DC of `addresses` relays from `now`: off for a lone relay or a
    /// zero interval.
    pub fn new(interval: Duration, addresses: usize, now: Instant, jitter: f64) -> Self {
        let on = addresses > 1 && !interval.is_zero();
        Self {
            interval,
            next_at: on.then(|| now + equal_jitter(interval, jitter)),
        }
    }

    /// When the next probe is due (`None`: never).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.next_at
    }

    /// Whether a probe is due at `now`; when it is, the next one is scheduled.
    pub fn handle_timeout(&mut self, now: Instant, jitter: f64) -> bool {
        match self.next_at {
            Some(at) if now >= at => {
                self.next_at = Some(now + equal_jitter(self.interval, jitter));
                true
            }
            _ => false,
        }
    }
}

/// Whether the followed relay of a DC with a standby went silent: alive enough to keep
/// its connections open (stopped, wedged, or behind a partition whose sockets never
/// reset) but sending nothing. Its load stream is the pulse: the relay closes a load
/// window every `window_ms` and sends each one, saying in it how long its windows are. A
/// relay that sends no window for [`Limits::relay_silence_windows`] of its own window
/// lengths (at least [`Limits::min_relay_silence`], at most
/// [`Limits::catalog_staleness_bound`], past which the catalog deadline ends the epoch
/// anyway) is left for the standby.
///
/// Only while the load stream is open: a relay whose load stream is down (refused, lost,
/// reopening) promises no pulse. Whether a silent relay is left is the link's call
/// ([`RelayLink::handle_silent`]): never a lone relay (leaving it would suspend its
/// replicas, not scored, for nothing to move to; it keeps the staleness bounds), and not
/// within the failover hold.
///
/// [`Limits::relay_silence_windows`]: crate::Limits::relay_silence_windows
/// [`Limits::min_relay_silence`]: crate::Limits::min_relay_silence
/// [`Limits::catalog_staleness_bound`]: crate::Limits::catalog_staleness_bound
#[derive(Debug, Clone)]
pub struct SilenceWatch {
    /// Window lengths of silence allowed; 0 when the watch is off.
    windows: u32,
    floor: Duration,
    cap: Duration,
    /// The last window's arrival and the silence it allows; `None` while no pulse is due.
    pulse: Option<(Instant, Duration)>,
}

impl SilenceWatch {
    /// A watch for one epoch (off when [`Limits::relay_silence_windows`] is 0).
    ///
    /// [`Limits::relay_silence_windows`]: crate::Limits::relay_silence_windows
    pub fn new(limits: &crate::Limits) -> Self {
        Self {
            windows: limits.relay_silence_windows,
            floor: limits.min_relay_silence,
            cap: limits.catalog_staleness_bound,
            pulse: None,
        }
    }

    /// A load window of `window_ms` arrived at `now`. The relay's figure is clamped, so a
    /// zero or absurd window length neither fails the relay at once nor disarms the watch.
    pub fn handle_window(&mut self, now: Instant, window_ms: u64) {
        if self.windows == 0 {
            return;
        }
        let allowed = Duration::from_millis(window_ms.saturating_mul(u64::from(self.windows)))
            .clamp(self.floor, self.cap.max(self.floor));
        self.pulse = Some((now, allowed));
    }

    /// No pulse is due until the load stream brings a window again: the stream is down,
    /// or a silence was noticed but the link stays.
    pub fn disarm(&mut self) {
        self.pulse = None;
    }

    /// When the relay counts as silent unless a window arrives first.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.pulse
            .and_then(|(heard, allowed)| heard.checked_add(allowed))
    }

    /// The deadline passed at `now`: how long the relay has been silent, if it is.
    pub fn handle_timeout(&self, now: Instant) -> Option<Duration> {
        let (heard, allowed) = self.pulse?;
        let silent_for = now.saturating_duration_since(heard);
        (silent_for >= allowed).then_some(silent_for)
    }
}

/// A stream that may come and go without ending the epoch (load, topology): while it is
/// down, its data is unknown and it reopens after backoff.
#[derive(Debug, Clone)]
pub struct SideStream {
    backoff: Backoff,
    opened_at: Instant,
    retry_at: Option<Instant>,
}

impl SideStream {
    /// A stream to open at once.
    pub fn new(backoff: BackoffConfig, now: Instant) -> Self {
        Self {
            backoff: Backoff::new(backoff),
            opened_at: now,
            retry_at: Some(now),
        }
    }

    /// It opened at `now`.
    pub fn handle_opened(&mut self, now: Instant) {
        self.opened_at = now;
        self.retry_at = None;
    }

    /// It was lost at `now` after running since it opened: reopen at the returned time.
    pub fn handle_lost(&mut self, now: Instant, jitter: f64) -> Instant {
        let healthy_for = now.saturating_duration_since(self.opened_at);
        self.retry_later(now, healthy_for, jitter)
    }

    /// Opening it failed at `now`: try again at the returned time.
    pub fn handle_open_failed(&mut self, now: Instant, jitter: f64) -> Instant {
        self.retry_later(now, Duration::ZERO, jitter)
    }

    /// When to (re)open it; `None` while it is open.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.retry_at
    }

    fn retry_later(&mut self, now: Instant, healthy_for: Duration, jitter: f64) -> Instant {
        let at = now + self.backoff.on_failure(healthy_for, jitter);
        self.retry_at = Some(at);
        at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOLD: Duration = Duration::from_secs(60);

    fn config() -> BackoffConfig {
        BackoffConfig {
            initial: Duration::from_millis(500),
            max: Duration::from_secs(30),
            healthy_reset: Duration::from_secs(30),
        }
    }

    fn silence_limits() -> crate::Limits {
        crate::Limits {
            relay_silence_windows: 3,
            min_relay_silence: Duration::from_secs(1),
            catalog_staleness_bound: Duration::from_secs(45),
            ..crate::Limits::default()
        }
    }

    /// A pair's followed relay is silent after three of its own windows without one, and
    /// each window re-arms the watch; a lost load stream disarms it until the next window.
    #[test]
    fn a_relay_that_stops_sending_windows_is_silent_after_three_of_them() {
        let start = Instant::now();
        let mut watch = SilenceWatch::new(&silence_limits());
        assert_eq!(
            watch.poll_timeout(),
            None,
            "no pulse due before the first window"
        );
        watch.handle_window(start, 1_000);
        assert_eq!(watch.poll_timeout(), Some(start + Duration::from_secs(3)));
        assert_eq!(
            watch.handle_timeout(start + Duration::from_millis(2_999)),
            None
        );
        let next = start + Duration::from_millis(900);
        watch.handle_window(next, 1_000);
        assert_eq!(watch.handle_timeout(start + Duration::from_secs(3)), None);
        assert_eq!(
            watch.handle_timeout(next + Duration::from_secs(4)),
            Some(Duration::from_secs(4))
        );
        watch.disarm();
        assert_eq!(watch.poll_timeout(), None);
        assert_eq!(watch.handle_timeout(next + Duration::from_secs(60)), None);
    }

    /// The relay's window length is clamped: a zero window cannot fail it at once, an
    /// absurd one (even `u64::MAX` ms) waits no longer than the catalog deadline.
    #[test]
    fn a_relays_window_length_is_clamped_between_the_floor_and_the_catalog_bound() {
        let start = Instant::now();
        let mut watch = SilenceWatch::new(&silence_limits());
        watch.handle_window(start, 0);
        assert_eq!(watch.poll_timeout(), Some(start + Duration::from_secs(1)));
        watch.handle_window(start, u64::MAX);
        assert_eq!(watch.poll_timeout(), Some(start + Duration::from_secs(45)));
        // A floor above the catalog bound wins (the operator asked for at least it).
        let limits = crate::Limits {
            min_relay_silence: Duration::from_secs(60),
            ..silence_limits()
        };
        let mut watch = SilenceWatch::new(&limits);
        watch.handle_window(start, 1_000);
        assert_eq!(watch.poll_timeout(), Some(start + Duration::from_secs(60)));
    }

    /// A watch turned off (0 windows) never counts a relay as silent.
    #[test]
    fn a_watch_turned_off_is_never_silent() {
        let start = Instant::now();
        let off = crate::Limits {
            relay_silence_windows: 0,
            ..silence_limits()
        };
        let mut watch = SilenceWatch::new(&off);
        watch.handle_window(start, 1_000);
        assert_eq!(watch.poll_timeout(), None);
        assert_eq!(
            watch.handle_timeout(start + Duration::from_secs(3_600)),
            None
        );
    }

    /// A pair's followed relay naming a stalled pool, or silent, is left; the relay
    /// reached that way is not left for a stall or silence of its own within the hold
    /// (both stalled or late: stay), but is after it; a lone relay, or a catalog with
    /// nothing stalled, is never left.
    #[test]
    fn a_stalled_pool_or_silence_moves_a_pair_once_per_hold() {
        let start = Instant::now();
        let hold = Duration::from_secs(60);
        let mut link = RelayLink::new(config(), HOLD, hold, 2);
        assert!(!link.handle_stalled(start, 0));
        assert!(link.handle_stalled(start, 1));
        assert!(!link.handle_stalled(start + Duration::from_secs(59), 3));
        assert!(!link.handle_silent(start + Duration::from_secs(59)));
        assert!(link.handle_silent(start + Duration::from_secs(60)));
        assert!(!link.handle_stalled(start + Duration::from_secs(61), 1));
        assert!(link.handle_stalled(start + Duration::from_secs(120), 1));
        let mut single = RelayLink::new(config(), HOLD, hold, 1);
        assert!(!single.handle_stalled(start, 5));
        assert!(!single.handle_silent(start));
    }

    /// A pair's standby is probed every interval (half of it jitter), from the start; a
    /// lone relay, or a zero interval, never.
    #[test]
    fn a_standby_is_probed_every_interval_and_a_lone_relay_never() {
        let start = Instant::now();
        let interval = Duration::from_secs(10);
        let mut probe = StandbyProbe::new(interval, 2, start, 0.0);
        assert_eq!(probe.poll_timeout(), Some(start + Duration::from_secs(5)));
        assert!(!probe.handle_timeout(start + Duration::from_millis(4_999), 1.0));
        let first = start + Duration::from_secs(5);
        assert!(probe.handle_timeout(first, 1.0));
        assert_eq!(probe.poll_timeout(), Some(first + interval));
        assert!(!probe.handle_timeout(first + Duration::from_secs(9), 1.0));
        assert!(probe.handle_timeout(first + interval, 0.5));
        assert_eq!(
            probe.poll_timeout(),
            Some(first + interval + Duration::from_millis(7_500))
        );
        for never in [
            StandbyProbe::new(interval, 1, start, 1.0),
            StandbyProbe::new(Duration::ZERO, 2, start, 1.0),
        ] {
            let mut never = never;
            assert_eq!(never.poll_timeout(), None);
            assert!(!never.handle_timeout(start + Duration::from_secs(3_600), 1.0));
        }
    }

    /// A pair: a relay that was followed and broke is replaced at once; the other is
    /// tried at once too when the first cannot be reached; only when both failed in a row
    /// does the link wait; and it stays on the relay that works.
    #[test]
    fn a_pair_fails_over_at_once_and_backs_off_only_when_both_fail() {
        let start = Instant::now();
        let mut link = RelayLink::new(config(), HOLD, HOLD, 2);
        assert_eq!(link.active(), 0);
        // The primary cannot be reached at start: the standby is tried at once.
        let (_, delay) = link.handle_epoch_end(
            start,
            EpochEnd::Broken,
            Duration::ZERO,
            Reach::Unreachable,
            1.0,
        );
        assert_eq!((link.active(), delay), (1, Duration::ZERO));
        // The standby cannot be reached either: back to the primary after the backoff.
        let (_, delay) = link.handle_epoch_end(
            start,
            EpochEnd::Broken,
            Duration::ZERO,
            Reach::Unreachable,
            1.0,
        );
        assert_eq!(link.active(), 0);
        assert!(delay > Duration::ZERO);
        // The primary is followed for a while, then dies: the standby at once.
        let later = start + Duration::from_secs(100);
        let (view, delay) = link.handle_epoch_end(
            later,
            EpochEnd::Broken,
            Duration::from_secs(60),
            Reach::Answered,
            1.0,
        );
        assert_eq!(
            (view, link.active(), delay),
            (ViewAfterEpoch::Suspend, 1, Duration::ZERO)
        );
        // A relay that restarted (invalidated) is left for the other one just the same.
        let (view, delay) = link.handle_epoch_end(
            later,
            EpochEnd::Invalidated,
            Duration::from_secs(1),
            Reach::Answered,
            1.0,
        );
        assert_eq!(
            (view, link.active(), delay),
            (ViewAfterEpoch::StartOver, 0, Duration::ZERO)
        );
        // Without a pair nothing moves and the backoff applies.
        let mut single = RelayLink::new(config(), HOLD, HOLD, 1);
        let (_, delay) = single.handle_epoch_end(
            later,
            EpochEnd::Broken,
            Duration::ZERO,
            Reach::Answered,
            1.0,
        );
        assert_eq!((single.active(), delay), (0, Duration::from_millis(500)));
    }

    /// After a followed relay's connection broke, attempts that reach no relay wait the
    /// rejoin interval (half of it jitter) until the window closes, then the backoff; the
    /// break itself, an attempt a relay declined (refused, TLS), and attempts before any
    /// break or after a restart was seen (invalidated) wait on the backoff.
    #[test]
    fn a_relay_that_went_away_is_retried_at_the_rejoin_interval_within_its_window() {
        let ms = Duration::from_millis;
        let start = Instant::now();
        let mut link =
            RelayLink::new(config(), HOLD, HOLD, 1).with_rejoin(ms(200), Duration::from_secs(10));
        let mut end_at = |at: Duration, healthy_for: Duration, reach: Reach, jitter: f64| {
            link.handle_epoch_end(start + at, EpochEnd::Broken, healthy_for, reach, jitter)
                .1
        };
        let broke = Duration::from_secs(60);
        // (at, epoch healthy for, reach, jitter, delay ms, why)
        #[rustfmt::skip]
        let steps = [
            (Duration::ZERO, Duration::ZERO, Reach::Unreachable, 1.0, 500, "never followed yet: the backoff"),
            (broke, broke, Reach::Answered, 1.0, 500, "the break itself: the backoff (reset by the healthy epoch)"),
            (broke, Duration::ZERO, Reach::Unreachable, 1.0, 200, "in the window"),
            (broke + ms(800), Duration::ZERO, Reach::Unreachable, 1.0, 200, "in the window"),
            (broke + ms(1_000), Duration::ZERO, Reach::Unreachable, 0.0, 100, "half of it is jitter"),
            (broke + ms(2_000), Duration::ZERO, Reach::Declined, 1.0, 1_000, "declined: the backoff, not grown by the rejoin"),
            (broke + ms(9_999), Duration::ZERO, Reach::Unreachable, 1.0, 200, "the window's last moment"),
            (broke + ms(10_000), Duration::ZERO, Reach::Unreachable, 1.0, 2_000, "the window closed"),
        ];
        for (at, healthy_for, reach, jitter, delay, why) in steps {
            assert_eq!(end_at(at, healthy_for, reach, jitter), ms(delay), "{why}");
        }
        let restarted = start + Duration::from_secs(100);
        link.handle_epoch_end(
            restarted,
            EpochEnd::Invalidated,
            Duration::ZERO,
            Reach::Answered,
            1.0,
        );
        let (_, delay) = link.handle_epoch_end(
            restarted + ms(1),
            EpochEnd::Broken,
            Duration::ZERO,
            Reach::Unreachable,
            1.0,
        );
        assert_eq!(delay, ms(8_000), "an invalidated epoch opens no window");
    }

    /// A pair whose followed relay broke tries the other at once, then both at the rejoin
    /// interval while neither can be reached.
    #[test]
    fn a_pair_rejoins_both_relays_at_the_rejoin_interval() {
        let ms = Duration::from_millis;
        let start = Instant::now();
        let mut link =
            RelayLink::new(config(), HOLD, HOLD, 2).with_rejoin(ms(200), Duration::from_secs(10));
        let (_, delay) = link.handle_epoch_end(
            start,
            EpochEnd::Broken,
            Duration::from_secs(60),
            Reach::Answered,
            1.0,
        );
        assert_eq!((link.active(), delay), (1, Duration::ZERO));
        for (step, expected) in [(1, 0), (2, 1), (3, 0)] {
            let (_, delay) = link.handle_epoch_end(
                start + ms(step),
                EpochEnd::Broken,
                Duration::ZERO,
                Reach::Unreachable,
                1.0,
            );
            assert_eq!((link.active(), delay), (expected, ms(200)));
        }
    }

    #[test]
    fn a_broken_epoch_suspends_until_the_resume_hold_then_starts_over() {
        let start = Instant::now();
        let mut link = RelayLink::new(config(), HOLD, HOLD, 1);
        assert_eq!(link.handle_epoch_start(start), None);
        let (view, delay) = link.handle_epoch_end(
            start,
            EpochEnd::Broken,
            Duration::ZERO,
            Reach::Answered,
            1.0,
        );
        assert_eq!(view, ViewAfterEpoch::Suspend);
        assert_eq!(delay, Duration::from_millis(500));
        // Reconnects keep failing: the hold runs from the first break.
        let later = start + Duration::from_secs(40);
        assert_eq!(link.handle_epoch_start(later), None);
        link.handle_epoch_end(
            later,
            EpochEnd::Broken,
            Duration::ZERO,
            Reach::Answered,
            1.0,
        );
        assert_eq!(
            link.handle_epoch_start(start + HOLD),
            None,
            "at the hold: still kept"
        );
        assert_eq!(
            link.handle_epoch_start(start + HOLD + Duration::from_millis(1)),
            Some(ViewAfterEpoch::StartOver)
        );
        // Once started over, the next break holds from its own time.
        let next_break = start + HOLD * 2;
        link.handle_epoch_end(
            next_break,
            EpochEnd::Broken,
            Duration::ZERO,
            Reach::Answered,
            1.0,
        );
        assert_eq!(link.handle_epoch_start(next_break + HOLD), None);
    }

    #[test]
    fn an_invalidated_epoch_starts_over_at_once_and_clears_the_hold() {
        let start = Instant::now();
        let mut link = RelayLink::new(config(), HOLD, HOLD, 1);
        link.handle_epoch_end(
            start,
            EpochEnd::Broken,
            Duration::ZERO,
            Reach::Answered,
            1.0,
        );
        let (view, _) = link.handle_epoch_end(
            start,
            EpochEnd::Invalidated,
            Duration::ZERO,
            Reach::Answered,
            1.0,
        );
        assert_eq!(view, ViewAfterEpoch::StartOver);
        assert_eq!(link.handle_epoch_start(start + HOLD * 3), None);
    }

    #[test]
    fn reconnect_delays_grow_until_an_epoch_stays_healthy() {
        let start = Instant::now();
        let mut link = RelayLink::new(config(), HOLD, HOLD, 1);
        let delays: Vec<Duration> = (0..3)
            .map(|_| {
                link.handle_epoch_end(
                    start,
                    EpochEnd::Broken,
                    Duration::from_secs(1),
                    Reach::Answered,
                    1.0,
                )
                .1
            })
            .collect();
        assert_eq!(
            delays,
            [500, 1000, 2000].map(Duration::from_millis).to_vec()
        );
        let (_, delay) = link.handle_epoch_end(
            start,
            EpochEnd::Broken,
            Duration::from_secs(30),
            Reach::Answered,
            1.0,
        );
        assert_eq!(delay, Duration::from_millis(500));
    }

    #[test]
    fn a_lost_side_stream_reopens_after_backoff_and_resets_when_it_held() {
        let start = Instant::now();
        let mut side = SideStream::new(config(), start);
        assert_eq!(side.poll_timeout(), Some(start), "opens at once");
        side.handle_opened(start);
        assert_eq!(side.poll_timeout(), None);
        let lost = start + Duration::from_secs(1);
        assert_eq!(
            side.handle_lost(lost, 1.0),
            lost + Duration::from_millis(500)
        );
        let failed = lost + Duration::from_millis(500);
        assert_eq!(
            side.handle_open_failed(failed, 1.0),
            failed + Duration::from_secs(1)
        );
        side.handle_opened(failed);
        // It held for the healthy period: the next loss starts from the first delay.
        let much_later = failed + Duration::from_secs(30);
        assert_eq!(
            side.handle_lost(much_later, 1.0),
            much_later + Duration::from_millis(500)
        );
    }
}
