//! A small in-test relay speaking the codec's WAN protocol over loopback TCP, fed by
//! `kvrelay-ckf` producer filters. Its streams are driven by the relay's own sans-IO
//! rules (ckf's `Publisher` for pool streams, the codec's `WatchSession` for watched
//! ones, the `PoolFrameEncoder` for frames): this fake only moves their bytes and injects
//! what only a connection shows (cuts, closed side streams). Test-only: a mutex is fine.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use kvrelay_ckf::Delta;
use kvrelay_ckf::stream::{Poll, Publisher, StreamLimits, SubscriberId, Transmit};
use kvrelay_codec::session::{WatchSession, Watched};
use kvrelay_codec::v1::{
    CatalogUpdate, ErrorMessage, ErrorReason, LoadWindow, Message, PoolDescriptor, PoolLoad,
    ProducerIdentity, RelayIdentity, RelayInfo, StreamRpc, WorkerRole, decode_message,
    encode_message,
};
use kvrelay_identity::hashing::HashSalt;
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::producer::*;

/// How often the fake's quiet pool streams heartbeat.
const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);

/// One producer: its filter, descriptor and the publication state machine its
/// subscribers are served from.
struct FakePool {
    spec: PoolSpec,
    /// The producer filter, its descriptor and the relay's frame encoder.
    producer: Producer,
    publisher: Publisher<()>,
    /// Bumped whenever a subscriber may have something new to send.
    wake: watch::Sender<u64>,
    /// Subscribers of the current generation.
    live: HashSet<SubscriberId>,
    /// Subscribers told to send a heartbeat once they have nothing else to send.
    heartbeat_now: HashSet<SubscriberId>,
    /// Subscribers whose connection is to be dropped (no error frame: a broken link).
    cut_now: HashSet<SubscriberId>,
}

impl FakePool {
    fn new(spec: PoolSpec, dc_name: &str, incarnation: u64, generation: u64) -> Self {
        let producer = Producer::new(&spec, dc_name, relay_identity(incarnation), generation);
        let filter = &producer.filter;
        // Quiet streams heartbeat every second (the relay's default is 10 s), so a
        // dropped frame shows as a gap within a test's patience even when nothing follows.
        let limits = StreamLimits {
            heartbeat_interval: HEARTBEAT_INTERVAL,
            ..StreamLimits::default()
        };
        let publisher = Publisher::new(filter.sequence(), filter.words().to_vec(), limits)
            .expect("default stream limits");
        Self {
            spec,
            producer,
            publisher,
            wake: watch::channel(0).0,
            live: HashSet::new(),
            heartbeat_now: HashSet::new(),
            cut_now: HashSet::new(),
        }
    }

    fn wake_all(&self) {
        self.wake.send_modify(|n| *n += 1);
    }
}

/// Knobs that make the fake misbehave once. Frame-level faults (lost, repeated, corrupted
/// frames, lag, a snapshot that never completes) are the sans-IO pair's (`pair.rs`); the
/// fake keeps what only a connection shows.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Faults {
    /// Close the next pool subscription after this many snapshot chunk frames.
    pub(crate) cut_after_chunks: Option<u32>,
}

struct Core {
    relay: RelayIdentity,
    dc_name: &'static str,
    revision: u64,
    pools: Vec<FakePool>,
    /// Raw descriptors appended to the catalog as they are (to test quarantine).
    extra: Vec<PoolDescriptor>,
    /// Pools withheld from the catalog as stalled (named in its `stalled` list).
    stalled: std::collections::BTreeSet<usize>,
    faults: Faults,
    catalog_tx: watch::Sender<CatalogUpdate>,
    load_tx: watch::Sender<LoadWindow>,
    /// The topology served on `WatchTopology`; `None` until a test publishes one.
    topology_tx: watch::Sender<Option<kvrelay_codec::v1::TopologyUpdate>>,
    topology_revision: u64,
    /// Bumped to close every open load stream.
    load_kill: watch::Sender<u64>,
    window_sequence: u64,
    subscriptions_opened: u64,
    load_streams_opened: u64,
    /// Pool streams open now, and the most ever open at once.
    pool_streams_open: u64,
    pool_streams_peak: u64,
}

/// The fake relay: a loopback listener and its state.
pub(crate) struct FakeRelay {
    pub(crate) addr: SocketAddr,
    core: Arc<Mutex<Core>>,
    cancel: CancellationToken,
    tracker: TaskTracker,
}

impl Core {
    fn catalog(&self) -> CatalogUpdate {
        let (stalled, listed): (Vec<_>, Vec<_>) = self
            .pools
            .iter()
            .enumerate()
            .partition(|(index, _)| self.stalled.contains(index));
        let mut pools: Vec<PoolDescriptor> = listed
            .iter()
            .map(|(_, p)| p.producer.descriptor.clone())
            .collect();
        pools.extend(self.extra.iter().cloned());
        CatalogUpdate {
            relay: self.relay,
            revision: self.revision,
            pools,
            coverage: Vec::new(),
            stalled: stalled
                .iter()
                .map(|(_, p)| p.producer.descriptor.producer.pool_id)
                .collect(),
            tier_lanes: Vec::new(),
        }
    }

    fn publish_catalog(&mut self) {
        self.revision += 1;
        let catalog = self.catalog();
        self.catalog_tx.send_replace(catalog);
    }

    /// Hands the producer's next delta to the pool's publisher and wakes its subscribers.
    fn publish_delta(&mut self, pool: usize, delta: Delta) {
        let fake = &mut self.pools[pool];
        fake.publisher
            .handle_delta(delta, Instant::now(), |_| ())
            .expect("the fake's filter and publisher agree");
        fake.wake_all();
    }
}

impl FakeRelay {
    /// Starts a relay for DC `dc_name` with `pools` on a free loopback port.
    pub(crate) async fn start(
        dc_name: &'static str,
        incarnation: u64,
        pools: Vec<PoolSpec>,
    ) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        Self::start_on(listener, dc_name, incarnation, pools)
    }

    /// Starts a relay on `addr` (e.g. the address of a stopped one).
    pub(crate) async fn restart_on(
        addr: SocketAddr,
        dc_name: &'static str,
        incarnation: u64,
        pools: Vec<PoolSpec>,
    ) -> Self {
        let listener = TcpListener::bind(addr).await.expect("rebind");
        Self::start_on(listener, dc_name, incarnation, pools)
    }

    fn start_on(
        listener: TcpListener,
        dc_name: &'static str,
        incarnation: u64,
        specs: Vec<PoolSpec>,
    ) -> Self {
        let addr = listener.local_addr().expect("local addr");
        let relay = relay_identity(incarnation);
        let pools: Vec<FakePool> = specs
            .into_iter()
            .map(|spec| FakePool::new(spec, dc_name, incarnation, 1))
            .collect();
        let (catalog_tx, _) = watch::channel(catalog_of(relay, 0, &[]));
        let (load_tx, _) = watch::channel(LoadWindow {
            relay,
            window_sequence: 0,
            observed_unix_ms: 0,
            window_ms: 1000,
            pools: Vec::new(),
        });
        let mut core = Core {
            relay,
            dc_name,
            revision: 0,
            pools,
            extra: Vec::new(),
            stalled: std::collections::BTreeSet::new(),
            faults: Faults::default(),
            catalog_tx,
            load_tx,
            topology_tx: watch::channel(None).0,
            topology_revision: 0,
            load_kill: watch::channel(0).0,
            window_sequence: 0,
            subscriptions_opened: 0,
            load_streams_opened: 0,
            pool_streams_open: 0,
            pool_streams_peak: 0,
        };
        core.publish_catalog();
        let core = Arc::new(Mutex::new(core));
        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        tracker.spawn(accept_loop(
            listener,
            Arc::clone(&core),
            cancel.clone(),
            tracker.clone(),
        ));
        Self {
            addr,
            core,
            cancel,
            tracker,
        }
    }

    /// `ADDR=DC` for the consumer's relay list.
    pub(crate) fn relay_arg(&self) -> String {
        format!("{}={}", self.addr, self.core.lock().dc_name)
    }

    /// Stops the listener and every connection.
    pub(crate) async fn stop(self) {
        self.cancel.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }

    /// Stores the blocks of `tokens` in pool `pool` (one chain from a fresh root, as one
    /// event from worker `worker`) and publishes the resulting delta. Returns the
    /// canonical sequence hashes stored.
    pub(crate) fn store(
        &self,
        pool: usize,
        worker: u64,
        tokens: &[u32],
        salt: HashSalt<'_>,
    ) -> Vec<u64> {
        let mut core = self.core.lock();
        let (hashes, delta) = core.pools[pool].producer.store_delta(worker, tokens, salt);
        if let Some(delta) = delta {
            core.publish_delta(pool, delta);
        }
        hashes
    }

    /// Clears every block of `worker` in pool `pool` and publishes the delta.
    pub(crate) fn clear(&self, pool: usize, worker: u64) {
        let mut core = self.core.lock();
        if let Some(delta) = core.pools[pool].producer.clear_delta(worker) {
            core.publish_delta(pool, delta);
        }
    }

    /// Has every subscriber of `pool` send a heartbeat once it has sent everything
    /// published so far (besides the publisher's own heartbeats when a stream is quiet).
    pub(crate) fn heartbeat(&self, pool: usize) {
        let mut core = self.core.lock();
        let fake = &mut core.pools[pool];
        fake.heartbeat_now.extend(fake.live.iter().copied());
        fake.wake_all();
    }

    /// Drops the connection of every subscriber of `pool`, as a broken link would.
    pub(crate) fn cut_pool_streams(&self, pool: usize) {
        let mut core = self.core.lock();
        let fake = &mut core.pools[pool];
        fake.cut_now.extend(fake.live.iter().copied());
        fake.wake_all();
    }

    /// The producer's current sequence and bucket words of `pool`.
    pub(crate) fn producer_state(&self, pool: usize) -> (u64, Vec<u64>) {
        let core = self.core.lock();
        let fake = &core.pools[pool];
        let filter = &fake.producer.filter;
        (filter.sequence(), filter.words().to_vec())
    }

    /// The producer identity of `pool`.
    pub(crate) fn producer(&self, pool: usize) -> ProducerIdentity {
        self.core.lock().pools[pool].producer.descriptor.producer
    }

    /// Whether the producer holds canonical hash `hash` in `pool`.
    pub(crate) fn contains(&self, pool: usize, hash: u64) -> bool {
        self.core.lock().pools[pool].producer.filter.contains(hash)
    }

    /// Replaces `pool`'s producer with a new layout generation (fresh, empty filter);
    /// current subscribers are told `producer_changed`.
    pub(crate) fn replace_producer(&self, pool: usize) {
        let mut core = self.core.lock();
        let incarnation = core.relay.relay_incarnation;
        let dc = core.dc_name;
        let old = &core.pools[pool];
        let generation = old.producer.descriptor.producer.layout_generation + 1;
        let replacement = FakePool::new(old.spec.clone(), dc, incarnation, generation);
        // The old generation's subscribers see the new producer on their next wake.
        let old = std::mem::replace(&mut core.pools[pool], replacement);
        old.wake_all();
        core.pools[pool].wake = old.wake;
        core.publish_catalog();
    }

    /// Appends a raw descriptor to the catalog (for quarantine tests) and publishes it.
    pub(crate) fn add_raw_descriptor(&self, build: impl FnOnce(PoolDescriptor) -> PoolDescriptor) {
        let mut core = self.core.lock();
        let template = core.pools[0].producer.descriptor.clone();
        core.extra.push(build(template));
        core.publish_catalog();
    }

    /// Withholds pool `pool` from the catalog as stalled (named in `stalled`), or lists it
    /// again, and publishes the catalog.
    pub(crate) fn set_stalled(&self, pool: usize, stalled: bool) {
        let mut core = self.core.lock();
        if stalled {
            core.stalled.insert(pool);
        } else {
            core.stalled.remove(&pool);
        }
        core.publish_catalog();
    }

    /// Removes every raw descriptor and publishes the catalog.
    pub(crate) fn clear_raw_descriptors(&self) {
        let mut core = self.core.lock();
        core.extra.clear();
        core.publish_catalog();
    }

    /// Publishes a load window for every pool: `used` of `total` blocks, full coverage.
    pub(crate) fn publish_load(&self, loads: &[(u64, u64)]) {
        let mut core = self.core.lock();
        core.window_sequence += 1;
        let pools = core
            .pools
            .iter()
            .zip(loads)
            .map(|(pool, &(used, total))| PoolLoad {
                producer: pool.producer.descriptor.producer,
                kv_used_blocks: Some(used),
                total_kv_blocks: Some(total),
                kv_observed_ranks: 1,
                kv_capacity_ranks: 1,
                kv_expected_ranks: 1,
                authoritative: true,
            })
            .collect();
        let window = LoadWindow {
            relay: core.relay,
            window_sequence: core.window_sequence,
            observed_unix_ms: 1,
            window_ms: 1000,
            pools,
        };
        core.load_tx.send_replace(window);
    }

    /// Publishes a complete topology: one entry per (namespace, base model, state).
    pub(crate) fn publish_topology(
        &self,
        entries: &[(&str, &str, kvrelay_codec::v1::ReadinessState)],
    ) {
        use kvrelay_codec::v1::{ReadinessState, TopologyEntry, TopologyUpdate};
        let mut core = self.core.lock();
        core.topology_revision += 1;
        let mut entries: Vec<TopologyEntry> = entries
            .iter()
            .map(|&(namespace, model, state)| TopologyEntry {
                namespace: namespace.to_owned(),
                canonical_model: model.to_owned(),
                state,
                present_roles: Vec::new(),
                missing_roles: if state == ReadinessState::Unavailable {
                    vec![WorkerRole::Aggregated]
                } else {
                    Vec::new()
                },
                members: Vec::new(),
                duplicate_role_endpoints: Vec::new(),
                legacy_fallback_active: false,
                adapters: Vec::new(),
            })
            .collect();
        entries.sort_by(|a, b| {
            (&a.namespace, &a.canonical_model).cmp(&(&b.namespace, &b.canonical_model))
        });
        let update = TopologyUpdate {
            relay: core.relay,
            revision: core.topology_revision,
            entries,
        };
        core.topology_tx.send_replace(Some(update));
    }

    /// Closes every open load stream.
    pub(crate) fn close_load_streams(&self) {
        self.core.lock().load_kill.send_modify(|n| *n += 1);
    }

    /// Arms one-shot faults.
    pub(crate) fn arm(&self, faults: Faults) {
        self.core.lock().faults = faults;
    }

    /// Load streams accepted so far.
    pub(crate) fn load_streams_opened(&self) -> u64 {
        self.core.lock().load_streams_opened
    }

    /// Pool subscriptions accepted so far.
    pub(crate) fn subscriptions_opened(&self) -> u64 {
        self.core.lock().subscriptions_opened
    }

    /// The most pool streams ever open at once.
    pub(crate) fn pool_streams_peak(&self) -> u64 {
        self.core.lock().pool_streams_peak
    }
}

/// Counts one open pool stream while it lives.
struct OpenPoolStream(Arc<Mutex<Core>>);

impl OpenPoolStream {
    fn new(core: &Arc<Mutex<Core>>) -> Self {
        let mut guard = core.lock();
        guard.pool_streams_open += 1;
        guard.pool_streams_peak = guard.pool_streams_peak.max(guard.pool_streams_open);
        Self(Arc::clone(core))
    }
}

impl Drop for OpenPoolStream {
    fn drop(&mut self) {
        self.0.lock().pool_streams_open -= 1;
    }
}

async fn accept_loop(
    listener: TcpListener,
    core: Arc<Mutex<Core>>,
    cancel: CancellationToken,
    tracker: TaskTracker,
) {
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((socket, _)) = accepted else { continue };
        let core = Arc::clone(&core);
        let cancel = cancel.clone();
        tracker.spawn(async move {
            tokio::select! {
                () = cancel.cancelled() => {}
                () = serve(socket, core) => {}
            }
        });
    }
}

async fn write(socket: &mut TcpStream, message: &Message) -> bool {
    let mut buf = BytesMut::new();
    encode_message(message, &limits(), &mut buf).expect("encode");
    socket.write_all(&buf).await.is_ok()
}

async fn serve(mut socket: TcpStream, core: Arc<Mutex<Core>>) {
    let mut buf = BytesMut::new();
    let request = loop {
        match decode_message(&mut buf, &limits()) {
            Ok(Some(Message::StreamRequest(request))) => break request,
            Ok(Some(_)) | Err(_) => return,
            Ok(None) => {}
        }
        match socket.read_buf(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    };
    match request.rpc {
        StreamRpc::RelayInfo => {
            let relay = core.lock().relay;
            let info = Message::RelayInfo(RelayInfo {
                protocol_major: kvrelay_codec::PROTOCOL_MAJOR,
                protocol_minor: kvrelay_codec::PROTOCOL_MINOR,
                relay,
                max_frame_len: limits().max_frame_len,
            });
            write(&mut socket, &info).await;
        }
        StreamRpc::WatchCatalog => {
            let rx = core.lock().catalog_tx.subscribe();
            serve_watch(&mut socket, rx, None).await;
        }
        StreamRpc::WatchLoad => {
            let (rx, mut kill) = {
                let mut guard = core.lock();
                guard.load_streams_opened += 1;
                (guard.load_tx.subscribe(), guard.load_kill.subscribe())
            };
            kill.borrow_and_update();
            serve_watch(&mut socket, rx, Some(kill)).await;
        }
        StreamRpc::SubscribePool {
            expected_producer,
            resume_from_sequence,
        } => serve_pool(socket, core, expected_producer, resume_from_sequence).await,
        StreamRpc::WatchTopology => {
            let mut rx = core.lock().topology_tx.subscribe();
            loop {
                let update = rx.borrow_and_update().clone();
                if let Some(update) = update
                    && !write(&mut socket, &Message::TopologyUpdate(update)).await
                {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        }
    }
}

/// Serves a watched stream by the relay's own rules (the codec's `WatchSession`: current
/// value first, then each superseding one, catalog re-sent when quiet, load windows only
/// when newer); this fake only moves the bytes. Ends when `kill` changes.
async fn serve_watch<T: Watched + Clone>(
    socket: &mut TcpStream,
    mut rx: watch::Receiver<T>,
    mut kill: Option<watch::Receiver<u64>>,
) {
    let now = || tokio::time::Instant::now().into_std();
    let current = Arc::new(rx.borrow_and_update().clone());
    let mut session = WatchSession::new(current, HEARTBEAT_INTERVAL, now());
    loop {
        while let Some(transmit) = session.poll_transmit() {
            if !write(socket, &transmit.value.to_message()).await {
                return;
            }
        }
        let heartbeat = session.poll_timeout().map(tokio::time::Instant::from_std);
        let killed = async {
            match kill.as_mut() {
                Some(kill) => {
                    let _ = kill.changed().await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = killed => return,
            changed = rx.changed() => {
                if changed.is_err() {
                    return;
                }
                let next = Arc::new(rx.borrow_and_update().clone());
                session.handle_value(next, now());
            }
            () = async {
                match heartbeat {
                    Some(deadline) => tokio::time::sleep_until(deadline).await,
                    None => std::future::pending().await,
                }
            } => session.handle_timeout(now()),
        }
    }
}

/// What a pool stream does next.
enum Step {
    Write(BytesMut),
    /// Write this, then end the stream.
    Finish(BytesMut),
    Close,
    Wait(Option<Instant>),
}

async fn serve_pool(
    mut socket: TcpStream,
    core: Arc<Mutex<Core>>,
    expected: ProducerIdentity,
    resume_from: Option<u64>,
) {
    let _open = OpenPoolStream::new(&core);
    let subscribed = subscribe(&core, expected, resume_from);
    let (pool, id, faults, mut wake) = match subscribed {
        Ok(subscribed) => subscribed,
        Err(reason) => {
            let error = Message::Error(ErrorMessage::new(reason, "not subscribed"));
            write(&mut socket, &error).await;
            return;
        }
    };
    let _unsubscribe = Unsubscribe {
        core: Arc::clone(&core),
        pool,
        producer: expected,
        id,
    };
    let mut chunks_sent = 0u32;
    loop {
        wake.borrow_and_update();
        let step = next_step(&core, pool, expected, id, &faults, &mut chunks_sent);
        match step {
            Step::Write(frame) => {
                if socket.write_all(&frame).await.is_err() {
                    return;
                }
            }
            Step::Finish(frame) => {
                let _ = socket.write_all(&frame).await;
                return;
            }
            Step::Close => return,
            Step::Wait(deadline) => {
                let sleep = async {
                    match deadline {
                        Some(at) => {
                            tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await;
                        }
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    changed = wake.changed() => if changed.is_err() { return },
                    () = sleep => {}
                }
            }
        }
    }
}

/// Takes a subscriber off its publisher when its stream ends.
struct Unsubscribe {
    core: Arc<Mutex<Core>>,
    pool: usize,
    producer: ProducerIdentity,
    id: SubscriberId,
}

impl Drop for Unsubscribe {
    fn drop(&mut self) {
        let mut core = self.core.lock();
        let fake = &mut core.pools[self.pool];
        // A replaced generation's publisher is gone with its subscribers.
        if fake.producer.descriptor.producer == self.producer {
            fake.publisher.handle_unsubscribe(self.id);
            fake.live.remove(&self.id);
            fake.heartbeat_now.remove(&self.id);
            fake.cut_now.remove(&self.id);
        }
    }
}

type Subscribed = (usize, SubscriberId, Faults, watch::Receiver<u64>);

fn subscribe(
    core: &Mutex<Core>,
    expected: ProducerIdentity,
    resume_from: Option<u64>,
) -> Result<Subscribed, ErrorReason> {
    let mut guard = core.lock();
    guard.subscriptions_opened += 1;
    let Some(pool) = guard
        .pools
        .iter()
        .position(|p| p.producer.descriptor.producer == expected)
    else {
        let known = guard
            .pools
            .iter()
            .any(|p| p.producer.descriptor.producer.pool_id == expected.pool_id);
        return Err(if known {
            ErrorReason::ProducerChanged
        } else {
            ErrorReason::PoolNotFound
        });
    };
    let faults = guard.faults;
    guard.faults.cut_after_chunks = None;
    let fake = &mut guard.pools[pool];
    let (id, _start) = fake
        .publisher
        .handle_subscribe(resume_from, true, Instant::now())
        .map_err(|_| ErrorReason::ResourceLimit)?;
    fake.live.insert(id);
    Ok((pool, id, faults, fake.wake.subscribe()))
}

/// Polls the publisher for `id` and encodes what it hands out, applying this
/// subscription's faults.
fn next_step(
    core: &Mutex<Core>,
    pool: usize,
    expected: ProducerIdentity,
    id: SubscriberId,
    faults: &Faults,
    chunks_sent: &mut u32,
) -> Step {
    let mut guard = core.lock();
    let fake = &mut guard.pools[pool];
    if fake.producer.descriptor.producer != expected {
        return Step::Finish(error_frame(
            ErrorReason::ProducerChanged,
            "generation retired",
        ));
    }
    let encoder = fake.producer.encoder;
    if fake.cut_now.remove(&id) {
        return Step::Close;
    }
    let heartbeat = |sequence| {
        let bytes = encoder.heartbeat(sequence, 0).expect("heartbeat");
        BytesMut::from(&bytes[..])
    };
    match fake.publisher.poll_transmit(id, Instant::now()) {
        Poll::Transmit(transmit) => {
            if let Transmit::SnapshotChunk { .. } = transmit {
                if faults.cut_after_chunks == Some(*chunks_sent) {
                    return Step::Close;
                }
                *chunks_sent += 1;
            }
            let encoded = encoder.transmit(&transmit, 0).expect("encode");
            let frame = BytesMut::from(&encoded.frame[..]);
            Step::Write(frame)
        }
        Poll::CutOff(cut) => Step::Finish(error_frame(cut_off_reason(cut), cut.label())),
        Poll::Unknown => Step::Close,
        Poll::Idle => {
            if fake.heartbeat_now.remove(&id) {
                return Step::Write(heartbeat(fake.publisher.sequence()));
            }
            Step::Wait(fake.publisher.poll_timeout(id))
        }
    }
}
