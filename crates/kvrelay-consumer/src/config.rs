//! Consumer configuration: the relays to watch, the ranking weights, backoff and bounds.

use std::str::FromStr;
use std::time::Duration;

use crate::weights::{ScoreWeights, WeightError};
use kvrelay_pacing::{BackoffConfig, BackoffConfigError};
use kvrelay_tls::{BearerToken, RelayConnector, RelayTls, TlsError};

/// One relay to watch: its address, the DC name it serves and a per-DC cost.
///
/// Parsed from `[PROTOCOL://]ADDR[+STANDBY..][=DC[:COST]]`, e.g. `10.0.0.7:7400=us-east:12.5`,
/// `10.0.0.7:7400+10.0.0.9:7400=us-east:12.5` (a relay pair of one DC) or
/// `dynamo-grpc://10.0.0.8:5561=eu-west:40` (a Dynamo relay). Without `=DC` the
/// address doubles as the DC name; without `:COST` the cost is 0. TLS and the bearer
/// token are off unless set (see [`RelayEndpoint::with_tls`], [`RelayEndpoint::with_token`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RelayEndpoint {
    /// `host:port` of the relay's WAN listener.
    pub addr: String,
    /// Further relays of the same DC (a relay pair: same cards, same sources), tried in
    /// order when the followed one fails; followed on demand, one at a time, never
    /// counted as another DC. Same protocol, TLS and token as `addr`.
    pub standby: Vec<String>,
    /// The DC label reported with scores.
    pub dc: String,
    /// The DC's cost in the ranking formula (e.g. network latency in ms); finite, ≥ 0.
    pub cost: f64,
    /// TLS towards this relay; `None` is plaintext TCP.
    pub tls: Option<RelayTls>,
    /// Bearer token sent in every stream request to this relay.
    pub token: Option<BearerToken>,
    /// The protocol this relay speaks: kvrelay's WAN protocol, or Dynamo's relay contract.
    pub protocol: RelayProtocol,
}

/// The protocol a relay is followed with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RelayProtocol {
    /// kvrelay's own WAN protocol (framed TCP; resume and coalesced deltas).
    #[default]
    Kvrelay,
    /// Dynamo's relay contract, gRPC `dynamo.kvrelay.v1`: a Dynamo KV DC Relay / Pool
    /// Relay, or a kvrelay relay's `[dynamo]` door. One HTTP/2 connection carries every
    /// stream to the relay; every pool stream starts with a snapshot.
    DynamoGrpc,
}

impl RelayProtocol {
    /// The name used in addresses (`dynamo-grpc://host:port`) and configuration.
    pub fn name(self) -> &'static str {
        match self {
            Self::Kvrelay => "kvrelay",
            Self::DynamoGrpc => "dynamo-grpc",
        }
    }
}

/// How a DC's further relays (a pair's standby, [`RelayEndpoint::standby`]) are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StandbyMode {
    /// Followed only when the followed relay fails (then one snapshot per pool, or a
    /// resume): half the WAN bytes and replica memory of [`StandbyMode::Hot`], a failover
    /// of one connection and snapshot. Idle standbys are probed
    /// ([`Limits::standby_probe_interval`]).
    #[default]
    OnDemand,
    /// Every address of a DC is followed all along, each with its own replicas, and only
    /// one of them is scored: a failover is a switch of which one, with no connection or
    /// snapshot, so the DC never leaves the ranking while one relay of it is current. Costs
    /// each relay's pool streams and replica memory once per address.
    Hot,
}

impl StandbyMode {
    /// The name used in configuration (`on-demand`, `hot`).
    pub fn name(self) -> &'static str {
        match self {
            Self::OnDemand => "on-demand",
            Self::Hot => "hot",
        }
    }
}

impl FromStr for StandbyMode {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Self, ConfigError> {
        match text {
            "on-demand" => Ok(Self::OnDemand),
            "hot" => Ok(Self::Hot),
            _ => Err(ConfigError::StandbyMode {
                text: text.to_owned(),
            }),
        }
    }
}

impl FromStr for RelayProtocol {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Self, ConfigError> {
        match text {
            "kvrelay" => Ok(Self::Kvrelay),
            "dynamo-grpc" => Ok(Self::DynamoGrpc),
            _ => Err(ConfigError::RelayProtocol {
                text: text.to_owned(),
            }),
        }
    }
}

impl RelayEndpoint {
    /// A relay at `addr` named `dc` with cost 0.
    pub fn new(addr: &str, dc: &str) -> Self {
        Self {
            addr: addr.to_owned(),
            standby: Vec::new(),
            dc: dc.to_owned(),
            cost: 0.0,
            tls: None,
            token: None,
            protocol: RelayProtocol::Kvrelay,
        }
    }

    /// This relay with `standby` relays of the same DC (a pair), tried in order when the
    /// followed one fails.
    #[must_use]
    pub fn with_standby(mut self, standby: Vec<String>) -> Self {
        self.standby = standby;
        self
    }

    /// Every address of this DC's relays: `addr`, then the standbys.
    pub fn addresses(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.addr.as_str()).chain(self.standby.iter().map(String::as_str))
    }

    /// This relay followed with `protocol`.
    #[must_use]
    pub fn with_protocol(mut self, protocol: RelayProtocol) -> Self {
        self.protocol = protocol;
        self
    }

    /// This relay reached over TLS.
    #[must_use]
    pub fn with_tls(mut self, tls: RelayTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// This relay given `token` in every stream request.
    #[must_use]
    pub fn with_token(mut self, token: BearerToken) -> Self {
        self.token = Some(token);
        self
    }

    /// Loads this relay's TLS material for `addr` (one of [`RelayEndpoint::addresses`]),
    /// if any (reads the PEM files).
    pub(crate) fn connector_for(&self, addr: &str) -> Result<Option<RelayConnector>, ConfigError> {
        self.tls
            .as_ref()
            .map(|tls| {
                RelayConnector::load(addr, tls).map_err(|source| ConfigError::Tls {
                    addr: addr.to_owned(),
                    source,
                })
            })
            .transpose()
    }
}

impl FromStr for RelayEndpoint {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Self, ConfigError> {
        let (protocol, address) = match text.split_once("://") {
            Some((scheme, address)) => (scheme.parse::<RelayProtocol>()?, address),
            None => (RelayProtocol::Kvrelay, text),
        };
        let (addrs, rest) = match address.split_once('=') {
            Some((addrs, rest)) => (addrs, Some(rest)),
            None => (address, None),
        };
        // `ADDR[+STANDBY...]`: a relay pair (or more) of one DC (`+` is in no host name
        // or port, and `,` already separates relays in lists).
        let mut addresses = addrs.split('+');
        let addr = addresses.next().unwrap_or_default();
        let standby: Vec<String> = addresses.map(str::to_owned).collect();
        if std::iter::once(addr)
            .chain(standby.iter().map(String::as_str))
            .any(|addr| addr.is_empty() || addr.trim() != addr)
        {
            return Err(ConfigError::RelayAddress {
                text: text.to_owned(),
            });
        }
        let (dc, cost) = match rest {
            None => (addr, 0.0),
            Some(rest) => match rest.rsplit_once(':') {
                None => (rest, 0.0),
                Some((dc, cost_text)) => {
                    let cost = cost_text
                        .parse::<f64>()
                        .ok()
                        .filter(|cost| cost.is_finite() && *cost >= 0.0)
                        .ok_or_else(|| ConfigError::RelayCost {
                            text: text.to_owned(),
                            cost: cost_text.to_owned(),
                        })?;
                    (dc, cost)
                }
            },
        };
        if dc.is_empty() || dc.trim() != dc {
            return Err(ConfigError::RelayDc {
                text: text.to_owned(),
            });
        }
        Ok(Self {
            cost,
            protocol,
            standby,
            ..Self::new(addr, dc)
        })
    }
}

/// Every bound of the consumer, each default a documented constant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest frame accepted from a relay, bytes.
    pub max_frame_len: u32,
    /// Catalog entries accepted per relay; a larger catalog fails that relay's epoch.
    pub max_pools_per_relay: usize,
    /// Pool streams open at once to one relay (each is a TCP connection); pools past it
    /// wait (not current) until a stream ends. Keep `relays × this` well under the
    /// process's descriptor limit. Must be > 0.
    pub max_pool_streams_per_relay: usize,
    /// Replica memory one relay's catalog may claim, bytes: the sum over that relay's
    /// admitted entries of `bucket_count × 8` (one 64-bit word per bucket). An entry that
    /// would take its relay past this is quarantined instead of admitted (entries kept
    /// from the relay's previous catalog first, then new ones in catalog order); must be
    /// > 0. One relay may otherwise advertise 4,096 pools of 2^24 buckets (128 MiB each).
    pub max_replica_bytes_per_relay: u64,
    /// Bytes the process's query tables may hold, over every relay: what replicas really
    /// take (a format's table holds its lanes rounded up to a power of two, so up to
    /// twice the lanes' own bytes), with a growing table's old and new copies counted
    /// together while it is laid out. A replica whose lane would pass it is not built
    /// (retried after backoff, counted as `over_budget`); this, not the per-relay share,
    /// is the bound on the process's replica memory. Must be > 0.
    pub max_query_table_bytes: u64,
    /// Time allowed to connect and receive the first frame of a stream.
    pub connect_timeout: Duration,
    /// Replicas older than this (time since the last snapshot, delta or heartbeat) are not
    /// used for scoring; their subscription is dropped and renewed.
    pub staleness_bound: Duration,
    /// Catalog streams older than this without a frame fail the relay's epoch. Only a
    /// catalog frame re-arms it (frames of other streams do not).
    pub catalog_staleness_bound: Duration,
    /// Longest time a snapshot may take to assemble, from its first chunk; a relay whose
    /// snapshot never completes (chunks restarted, or never sent) has the subscription
    /// renewed after backoff (counted as `stale`).
    pub snapshot_assembly_timeout: Duration,
    /// How long a relay's catalog and replicas are kept (suspended, not scored) after its
    /// connection broke, so a reconnect to the same incarnation resumes every pool
    /// without a snapshot; after this they are dropped when the relay comes back.
    pub resume_hold: Duration,
    /// A DC followed through a relay pair leaves its followed relay for the standby when
    /// that relay sends no load window for this many of its own window lengths (each
    /// window says how long it is; 1 s by default): a relay that is stopped, wedged or
    /// behind a partition keeps its sockets open and would otherwise be noticed only by
    /// `catalog_staleness_bound`. 0 turns it off. A lone relay is never left for silence
    /// (there is nowhere to go; its replicas keep `staleness_bound`). With
    /// [`StandbyMode::Hot`] a silent relay stays followed and its DC is scored through
    /// another of its relays that is not silent.
    pub relay_silence_windows: u32,
    /// The least silence [`Limits::relay_silence_windows`] allows, whatever window length
    /// the relay announces (a relay announcing 0 ms is not left at once). Must be > 0.
    pub min_relay_silence: Duration,
    /// A DC followed through a relay pair leaves its followed relay for the next one when
    /// that relay goes silent ([`Limits::relay_silence_windows`]) or its catalog names a
    /// stalled pool, but not again for either within this long of the last such move: if
    /// both relays are late or stalled, the consumer stays where it is instead of moving
    /// (and re-snapshotting every pool) back and forth. A broken connection always moves
    /// it at once. Must be > 0.
    pub failover_hold: Duration,
    /// After a followed relay's connection broke, attempts that reach no relay (refused,
    /// timed out) are retried every this long (half of it jitter) for
    /// [`Limits::rejoin_window`] instead of on the doubling backoff, so a relay that
    /// restarts in a second or two is followed again within this of its return rather
    /// than a whole backoff step later. Must be > 0.
    pub rejoin_interval: Duration,
    /// How long after a followed relay's connection broke [`Limits::rejoin_interval`]
    /// applies; then (and to attempts a relay refused, or whose TLS handshake failed) the
    /// backoff. 0 turns it off.
    pub rejoin_window: Duration,
    /// A DC followed through a relay pair has each relay it does not follow asked for its
    /// relay info every this long (half of it jitter), so a dead standby shows in
    /// [`crate::RelayStatus::standbys`] and `standbys_unreachable` before a failover needs
    /// it. 0 turns it off.
    pub standby_probe_interval: Duration,
}

impl Limits {
    /// Default [`Limits::max_frame_len`]: 8 MiB, the codec's default.
    pub const DEFAULT_MAX_FRAME_LEN: u32 = 8 << 20;
    /// Default [`Limits::max_pools_per_relay`].
    pub const DEFAULT_MAX_POOLS_PER_RELAY: usize = 4096;
    /// Default [`Limits::max_pool_streams_per_relay`]: 256 (four relays fit a
    /// 1,024-descriptor limit with room for the API).
    pub const DEFAULT_MAX_POOL_STREAMS_PER_RELAY: usize = 256;
    /// Default [`Limits::max_replica_bytes_per_relay`]: 4 GiB (32 pools of the largest
    /// filter, 2^24 buckets, or 4,096 pools of 2^17 buckets).
    pub const DEFAULT_MAX_REPLICA_BYTES_PER_RELAY: u64 = 4 << 30;
    /// Default [`Limits::max_query_table_bytes`]: 8 GiB (one relay at its default share,
    /// 4 GiB of lanes, in a table of 4 GiB; or the growth from 2 GiB to 4 GiB of lanes of
    /// one format, both held for the re-layout, with 2 GiB to spare).
    pub const DEFAULT_MAX_QUERY_TABLE_BYTES: u64 = 8 << 30;
    /// Default [`Limits::connect_timeout`]: 5 s.
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
    /// Default [`Limits::staleness_bound`]: 30 s, three relay heartbeat intervals.
    pub const DEFAULT_STALENESS_BOUND: Duration = Duration::from_secs(30);
    /// Default [`Limits::catalog_staleness_bound`]: 45 s.
    pub const DEFAULT_CATALOG_STALENESS_BOUND: Duration = Duration::from_secs(45);
    /// Default [`Limits::snapshot_assembly_timeout`]: 120 s (a 2^24-bucket snapshot is
    /// 128 MiB: about 10 s at 100 Mbit/s).
    pub const DEFAULT_SNAPSHOT_ASSEMBLY_TIMEOUT: Duration = Duration::from_secs(120);
    /// Default [`Limits::resume_hold`]: 60 s.
    pub const DEFAULT_RESUME_HOLD: Duration = Duration::from_secs(60);
    /// Default [`Limits::relay_silence_windows`]: 3 (3 s at the relay's default 1 s
    /// windows: two windows may be late under load without a failover).
    pub const DEFAULT_RELAY_SILENCE_WINDOWS: u32 = 3;
    /// Default [`Limits::min_relay_silence`]: 1 s.
    pub const DEFAULT_MIN_RELAY_SILENCE: Duration = Duration::from_secs(1);
    /// Default [`Limits::failover_hold`]: 60 s.
    pub const DEFAULT_FAILOVER_HOLD: Duration = Duration::from_secs(60);
    /// Default [`Limits::rejoin_interval`]: 200 ms (a retry every 100–200 ms).
    pub const DEFAULT_REJOIN_INTERVAL: Duration = Duration::from_millis(200);
    /// Default [`Limits::rejoin_window`]: 10 s (a restart with a checkpoint is back in
    /// about a second; a relay gone longer is retried on the backoff).
    pub const DEFAULT_REJOIN_WINDOW: Duration = Duration::from_secs(10);
    /// Default [`Limits::standby_probe_interval`]: 10 s (a connection and one answer per
    /// standby every 5–10 s).
    pub const DEFAULT_STANDBY_PROBE_INTERVAL: Duration = Duration::from_secs(10);
}

impl Limits {
    /// Every timeout must be positive: a zero connect timeout fails every connection and a
    /// zero staleness bound every stream.
    fn validate_durations(&self) -> Result<(), ConfigError> {
        let durations = [
            ("connect_timeout", self.connect_timeout),
            ("staleness_bound", self.staleness_bound),
            ("catalog_staleness_bound", self.catalog_staleness_bound),
            ("snapshot_assembly_timeout", self.snapshot_assembly_timeout),
            ("min_relay_silence", self.min_relay_silence),
            ("failover_hold", self.failover_hold),
            ("rejoin_interval", self.rejoin_interval),
        ];
        match durations.into_iter().find(|(_, value)| value.is_zero()) {
            Some((field, _)) => Err(ConfigError::ZeroDuration { field }),
            None => Ok(()),
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_frame_len: Self::DEFAULT_MAX_FRAME_LEN,
            max_pools_per_relay: Self::DEFAULT_MAX_POOLS_PER_RELAY,
            max_replica_bytes_per_relay: Self::DEFAULT_MAX_REPLICA_BYTES_PER_RELAY,
            max_pool_streams_per_relay: Self::DEFAULT_MAX_POOL_STREAMS_PER_RELAY,
            max_query_table_bytes: Self::DEFAULT_MAX_QUERY_TABLE_BYTES,
            connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT,
            staleness_bound: Self::DEFAULT_STALENESS_BOUND,
            catalog_staleness_bound: Self::DEFAULT_CATALOG_STALENESS_BOUND,
            snapshot_assembly_timeout: Self::DEFAULT_SNAPSHOT_ASSEMBLY_TIMEOUT,
            resume_hold: Self::DEFAULT_RESUME_HOLD,
            relay_silence_windows: Self::DEFAULT_RELAY_SILENCE_WINDOWS,
            min_relay_silence: Self::DEFAULT_MIN_RELAY_SILENCE,
            failover_hold: Self::DEFAULT_FAILOVER_HOLD,
            rejoin_interval: Self::DEFAULT_REJOIN_INTERVAL,
            rejoin_window: Self::DEFAULT_REJOIN_WINDOW,
            standby_probe_interval: Self::DEFAULT_STANDBY_PROBE_INTERVAL,
        }
    }
}

/// The whole consumer configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ConsumerConfig {
    /// The relays to watch, one per DC; any number.
    pub relays: Vec<RelayEndpoint>,
    /// Ranking weights.
    pub weights: ScoreWeights,
    /// Reconnect and resubscribe backoff.
    pub backoff: BackoffConfig,
    /// Bounds and timeouts.
    pub limits: Limits,
    /// Diagnostic label sent with every stream request (suffixed per stream).
    pub subscriber_id: String,
    /// How a DC's standby relays are kept: followed on demand, or all along.
    pub standby: StandbyMode,
    /// Whether pools' lower-tier lanes (host memory, disk; relays with `[tiers]`) are
    /// followed and scored. Off: device memory only, as with a relay that keeps no lanes
    /// (no lane replica memory). Default on.
    pub follow_tier_lanes: bool,
    /// Whether a pool's format twin (a relay with `[filters] format = "v1_and_dense"`
    /// publishes each v1 pool's blocks again in the dense format) is followed in place of
    /// the pool's own filter: the same blocks in about 0.63x the replica memory, at about
    /// twice v1's false-positive rate per probe (~1.2e-4 against ~6e-5). Off:
    /// every pool is followed in its own format. Default on.
    pub follow_format_twins: bool,
}

impl ConsumerConfig {
    /// A configuration with defaults for everything but the relays.
    pub fn new(relays: Vec<RelayEndpoint>) -> Self {
        Self {
            relays,
            weights: ScoreWeights::default(),
            backoff: BackoffConfig::default(),
            limits: Limits::default(),
            subscriber_id: "kvrelay-consumer".to_owned(),
            standby: StandbyMode::OnDemand,
            follow_tier_lanes: true,
            follow_format_twins: true,
        }
    }

    /// The relays the consumer follows, each with the index of its DC in
    /// [`ConsumerConfig::relays`]: one per DC (its standbys tried in turn) with
    /// [`StandbyMode::OnDemand`], one per address (each a lone relay) with
    /// [`StandbyMode::Hot`].
    pub fn followed_relays(&self) -> Vec<(usize, RelayEndpoint)> {
        match self.standby {
            StandbyMode::OnDemand => self.relays.iter().cloned().enumerate().collect(),
            StandbyMode::Hot => self
                .relays
                .iter()
                .enumerate()
                .flat_map(|(dc, relay)| {
                    relay.addresses().map(move |addr| {
                        (
                            dc,
                            RelayEndpoint {
                                addr: addr.to_owned(),
                                standby: Vec::new(),
                                ..relay.clone()
                            },
                        )
                    })
                })
                .collect(),
        }
    }

    /// The most sockets this consumer holds open at once, by its bounds: per followed
    /// relay on kvrelay's protocol, its catalog, load and topology streams plus
    /// [`Limits::max_pool_streams_per_relay`] pool and lane streams; on Dynamo's contract,
    /// one HTTP/2 connection; with [`StandbyMode::OnDemand`], one probe per standby
    /// address besides. A process embedding the consumer needs this many descriptors
    /// beyond its own (the router adds its listener's and warns at start when the open
    /// file limit is lower).
    pub fn max_open_connections(&self) -> u64 {
        const SIDE_STREAMS: u64 = 3;
        let pool_streams = self.limits.max_pool_streams_per_relay as u64;
        let followed: u64 = self
            .followed_relays()
            .iter()
            .map(|(_, relay)| match relay.protocol {
                RelayProtocol::Kvrelay => SIDE_STREAMS.saturating_add(pool_streams),
                RelayProtocol::DynamoGrpc => 1,
            })
            .fold(0, u64::saturating_add);
        let probes: u64 = match self.standby {
            StandbyMode::OnDemand => self.relays.iter().map(|r| r.standby.len() as u64).sum(),
            StandbyMode::Hot => 0,
        };
        followed.saturating_add(probes)
    }

    /// Checks the relay list, weights and bounds, and loads every relay's TLS material
    /// (so a missing or malformed PEM file is reported here, naming the file).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.relays.is_empty() {
            return Err(ConfigError::NoRelays);
        }
        for (idx, relay) in self.relays.iter().enumerate() {
            if self.relays[..idx].iter().any(|other| other.dc == relay.dc) {
                return Err(ConfigError::DuplicateDc {
                    dc: relay.dc.clone(),
                });
            }
            if !relay.cost.is_finite() || relay.cost < 0.0 {
                return Err(ConfigError::RelayCost {
                    text: relay.addr.clone(),
                    cost: relay.cost.to_string(),
                });
            }
            for (at, addr) in relay.addresses().enumerate() {
                if addr.is_empty() || addr.trim() != addr {
                    return Err(ConfigError::RelayAddress {
                        text: addr.to_owned(),
                    });
                }
                if relay.addresses().take(at).any(|other| other == addr) {
                    return Err(ConfigError::DuplicateAddress {
                        dc: relay.dc.clone(),
                        addr: addr.to_owned(),
                    });
                }
                relay.connector_for(addr)?;
            }
        }
        self.weights.validate()?;
        self.backoff.validate()?;
        if self.limits.max_replica_bytes_per_relay == 0 {
            return Err(ConfigError::ZeroReplicaBudget);
        }
        if self.limits.max_query_table_bytes == 0 {
            return Err(ConfigError::ZeroQueryTableBudget);
        }
        self.limits.validate_durations()?;
        if self.limits.max_pool_streams_per_relay == 0 {
            return Err(ConfigError::ZeroPoolStreams);
        }
        // The stream suffix ("/catalog", "/pool") must still fit the 128-byte id limit.
        if self.subscriber_id.is_empty()
            || self.subscriber_id.len() > 112
            || self.subscriber_id.chars().any(char::is_control)
        {
            return Err(ConfigError::SubscriberId {
                id: self.subscriber_id.clone(),
            });
        }
        Ok(())
    }
}

/// A configuration that cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A standby mode other than `on-demand` or `hot`.
    #[error("unknown standby mode {text:?} (expected on-demand or hot)")]
    StandbyMode {
        /// The mode as written.
        text: String,
    },
    /// A relay address names a protocol other than `kvrelay` or `dynamo-grpc`.
    #[error("unknown relay protocol {text:?} (expected kvrelay or dynamo-grpc)")]
    RelayProtocol {
        /// The protocol as written.
        text: String,
    },
    /// `max_pool_streams_per_relay` is zero (no pool could ever be followed).
    #[error("consumer limit max_pool_streams_per_relay must be greater than zero")]
    ZeroPoolStreams,
    /// A timeout is zero.
    #[error("consumer limit {field} must be greater than zero")]
    ZeroDuration {
        /// The limit.
        field: &'static str,
    },
    /// `ADDR` is empty or has surrounding whitespace.
    #[error("relay {text:?}: address must be non-empty host:port")]
    RelayAddress {
        /// The whole relay argument.
        text: String,
    },
    /// The DC name is empty or has surrounding whitespace.
    #[error("relay {text:?}: dc name must be non-empty without surrounding whitespace")]
    RelayDc {
        /// The whole relay argument.
        text: String,
    },
    /// The cost is not a finite number ≥ 0.
    #[error("relay {text:?}: cost {cost:?} must be a finite number >= 0")]
    RelayCost {
        /// The whole relay argument.
        text: String,
        /// The rejected cost text.
        cost: String,
    },
    /// No relay configured.
    #[error("at least one relay must be configured")]
    NoRelays,
    /// One address appears twice among one DC's relays.
    #[error("dc {dc:?}: relay address {addr} is listed twice")]
    DuplicateAddress {
        /// The DC.
        dc: String,
        /// The repeated address.
        addr: String,
    },
    /// Two relays claim the same DC name.
    #[error("dc {dc:?} is configured for more than one relay")]
    DuplicateDc {
        /// The repeated DC name.
        dc: String,
    },
    /// The subscriber id is empty, too long (> 112 bytes) or has control characters.
    #[error("subscriber id {id:?} must be 1..=112 bytes without control characters")]
    SubscriberId {
        /// The rejected id.
        id: String,
    },
    /// [`Limits::max_replica_bytes_per_relay`] is 0: no replica could ever be admitted.
    #[error("max_replica_bytes_per_relay must be > 0")]
    ZeroReplicaBudget,
    /// [`Limits::max_query_table_bytes`] is 0: no replica could ever be built.
    #[error("max_query_table_bytes must be > 0")]
    ZeroQueryTableBudget,
    /// A relay's TLS material cannot be loaded.
    #[error("relay {addr}: {source}")]
    Tls {
        /// The relay's address.
        addr: String,
        /// What is wrong.
        #[source]
        source: TlsError,
    },
    /// A ranking weight is invalid.
    #[error(transparent)]
    Weight(#[from] WeightError),
    /// The reconnect backoff cannot work.
    #[error("consumer backoff: {0}")]
    Backoff(#[from] BackoffConfigError),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sockets at once: 3 side streams + the pool-stream bound per followed kvrelay relay,
    /// one connection per Dynamo relay, one probe per on-demand standby; hot standbys are
    /// followed relays of their own.
    #[test]
    fn max_open_connections_counts_every_stream_the_bounds_allow() {
        let kvrelay = RelayEndpoint::new("127.0.0.1:7400", "a")
            .with_standby(vec!["127.0.0.1:7401".into(), "127.0.0.1:7402".into()]);
        let dynamo = RelayEndpoint {
            protocol: RelayProtocol::DynamoGrpc,
            ..RelayEndpoint::new("127.0.0.1:7500", "b")
        };
        let mut config = ConsumerConfig::new(vec![kvrelay, dynamo]);
        config.limits.max_pool_streams_per_relay = 10;
        assert_eq!(config.max_open_connections(), (3 + 10) + 1 + 2);
        config.standby = StandbyMode::Hot;
        assert_eq!(config.max_open_connections(), 3 * (3 + 10) + 1);
        config.limits.max_pool_streams_per_relay = usize::MAX;
        assert_eq!(config.max_open_connections(), u64::MAX, "saturates");
    }

    fn check(text: &str, addr: &str, dc: &str, cost: f64) {
        let relay: RelayEndpoint = text.parse().unwrap();
        assert_eq!(
            relay,
            RelayEndpoint {
                cost,
                ..RelayEndpoint::new(addr, dc)
            },
            "{text}"
        );
    }

    #[test]
    fn relay_argument_parses_address_dc_and_cost() {
        check("127.0.0.1:7400", "127.0.0.1:7400", "127.0.0.1:7400", 0.0);
        check("127.0.0.1:7400=us-east", "127.0.0.1:7400", "us-east", 0.0);
        check("relay.b:7400=eu-west:35.5", "relay.b:7400", "eu-west", 35.5);
        check("[::1]:7400=v6:2", "[::1]:7400", "v6", 2.0);
    }

    /// `ADDR+STANDBY=DC` is one DC followed through a relay pair; an empty or repeated
    /// address is refused.
    #[test]
    fn relay_argument_names_a_pair_of_one_dc() {
        let pair: RelayEndpoint = "10.0.0.1:7400+10.0.0.2:7400=dc-a:5".parse().unwrap();
        assert_eq!(
            pair,
            RelayEndpoint {
                cost: 5.0,
                ..RelayEndpoint::new("10.0.0.1:7400", "dc-a")
                    .with_standby(vec!["10.0.0.2:7400".into()])
            }
        );
        assert_eq!(
            pair.addresses().collect::<Vec<_>>(),
            ["10.0.0.1:7400", "10.0.0.2:7400"]
        );
        assert!(ConsumerConfig::new(vec![pair]).validate().is_ok());
        for text in ["a:1+=dc", "a:1+ b:1=dc", "+a:1=dc"] {
            assert!(
                matches!(
                    text.parse::<RelayEndpoint>(),
                    Err(ConfigError::RelayAddress { .. })
                ),
                "{text}"
            );
        }
        let repeated: RelayEndpoint = "a:1+a:1=dc".parse().unwrap();
        assert_eq!(
            ConsumerConfig::new(vec![repeated]).validate(),
            Err(ConfigError::DuplicateAddress {
                dc: "dc".into(),
                addr: "a:1".into()
            })
        );
    }

    #[test]
    fn relay_argument_with_bad_cost_is_rejected() {
        for text in ["a:1=dc:-1", "a:1=dc:nan", "a:1=dc:fast", "a:1=dc:inf"] {
            assert!(
                matches!(
                    text.parse::<RelayEndpoint>(),
                    Err(ConfigError::RelayCost { .. })
                ),
                "{text}"
            );
        }
    }

    #[test]
    fn relay_argument_names_its_protocol_with_a_scheme() {
        let relay: RelayEndpoint = "dynamo-grpc://10.0.0.8:5561=eu-west:40".parse().unwrap();
        assert_eq!(
            relay,
            RelayEndpoint {
                cost: 40.0,
                ..RelayEndpoint::new("10.0.0.8:5561", "eu-west")
                    .with_protocol(RelayProtocol::DynamoGrpc)
            }
        );
        let plain: RelayEndpoint = "kvrelay://10.0.0.7:7400".parse().unwrap();
        assert_eq!(plain, RelayEndpoint::new("10.0.0.7:7400", "10.0.0.7:7400"));
        assert_eq!(
            "grpc://a:1".parse::<RelayEndpoint>(),
            Err(ConfigError::RelayProtocol {
                text: "grpc".into()
            })
        );
    }

    #[test]
    fn standby_modes_parse_from_their_names_and_hot_follows_every_address() {
        for mode in [StandbyMode::OnDemand, StandbyMode::Hot] {
            assert_eq!(mode.name().parse::<StandbyMode>(), Ok(mode));
        }
        assert_eq!(
            "warm".parse::<StandbyMode>(),
            Err(ConfigError::StandbyMode {
                text: "warm".into()
            })
        );
        let mut config = ConsumerConfig::new(vec![
            "10.0.0.1:7400+10.0.0.2:7400=us-east".parse().unwrap(),
            "10.0.0.3:7400=eu-west".parse().unwrap(),
        ]);
        assert_eq!(config.followed_relays().len(), 2, "one per DC on demand");
        config.standby = StandbyMode::Hot;
        let followed: Vec<(usize, String, usize)> = config
            .followed_relays()
            .into_iter()
            .map(|(dc, relay)| (dc, relay.addr, relay.standby.len()))
            .collect();
        assert_eq!(
            followed,
            [
                (0, "10.0.0.1:7400".to_owned(), 0),
                (0, "10.0.0.2:7400".to_owned(), 0),
                (1, "10.0.0.3:7400".to_owned(), 0)
            ]
        );
    }

    #[test]
    fn relay_argument_with_empty_parts_is_rejected() {
        assert!(matches!(
            "=dc".parse::<RelayEndpoint>(),
            Err(ConfigError::RelayAddress { .. })
        ));
        assert!(matches!(
            "a:1=".parse::<RelayEndpoint>(),
            Err(ConfigError::RelayDc { .. })
        ));
        assert!(matches!(
            "a:1=:3".parse::<RelayEndpoint>(),
            Err(ConfigError::RelayDc { .. })
        ));
    }

    #[test]
    fn duplicate_dc_names_are_rejected() {
        let config = ConsumerConfig::new(vec![
            RelayEndpoint::new("a:1", "x"),
            RelayEndpoint::new("b:1", "x"),
        ]);
        assert_eq!(
            config.validate(),
            Err(ConfigError::DuplicateDc { dc: "x".into() })
        );
    }

    #[test]
    fn zero_replica_budget_is_rejected() {
        let mut config = ConsumerConfig::new(vec![RelayEndpoint::new("a:1", "x")]);
        config.limits.max_replica_bytes_per_relay = 0;
        assert_eq!(config.validate(), Err(ConfigError::ZeroReplicaBudget));
        config.limits.max_replica_bytes_per_relay = 1;
        config.limits.max_query_table_bytes = 0;
        assert_eq!(config.validate(), Err(ConfigError::ZeroQueryTableBudget));
    }

    #[test]
    fn zero_timeouts_are_rejected_naming_the_limit() {
        let base = ConsumerConfig::new(vec![RelayEndpoint::new("a:1", "x")]);
        let zeroed = |field: &str| {
            let mut config = base.clone();
            let limits = &mut config.limits;
            match field {
                "connect_timeout" => limits.connect_timeout = Duration::ZERO,
                "staleness_bound" => limits.staleness_bound = Duration::ZERO,
                "catalog_staleness_bound" => limits.catalog_staleness_bound = Duration::ZERO,
                "min_relay_silence" => limits.min_relay_silence = Duration::ZERO,
                "failover_hold" => limits.failover_hold = Duration::ZERO,
                "rejoin_interval" => limits.rejoin_interval = Duration::ZERO,
                _ => limits.snapshot_assembly_timeout = Duration::ZERO,
            }
            config
        };
        for field in [
            "connect_timeout",
            "staleness_bound",
            "catalog_staleness_bound",
            "snapshot_assembly_timeout",
            "min_relay_silence",
            "failover_hold",
            "rejoin_interval",
        ] {
            assert_eq!(
                zeroed(field).validate(),
                Err(ConfigError::ZeroDuration { field })
            );
        }
        assert_eq!(base.validate(), Ok(()));
    }

    #[test]
    fn empty_relay_list_is_rejected() {
        assert_eq!(
            ConsumerConfig::new(Vec::new()).validate(),
            Err(ConfigError::NoRelays)
        );
    }
}
