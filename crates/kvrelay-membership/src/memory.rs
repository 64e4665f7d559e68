//! [`MemoryDiscovery`]: an in-process card store for tests and embedding.
//!
//! Each watch gets a bounded queue ([`MembershipLimits::memory_watch_queue_depth`]); a watch whose queue is
//! full is closed, and its owner rebinds (re-lists) rather than missing a change. Test hooks
//! change the store without notifying watches, close every watch, or fail the next opens.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use tokio::sync::mpsc;

use crate::discovery::{Discovery, DiscoveryError, DiscoveryFuture, DiscoveryWatch};
use crate::instance::{DiscoveryEvent, DiscoveryQuery, ModelCardInstance, ModelCardInstanceId};
use crate::limits::MembershipLimits;

/// An in-memory discovery store.
#[derive(Debug, Default)]
pub struct MemoryDiscovery {
    state: Mutex<MemoryState>,
    limits: MembershipLimits,
}

#[derive(Debug, Default)]
struct MemoryState {
    cards: BTreeMap<ModelCardInstanceId, serde_json::Value>,
    watches: Vec<(
        DiscoveryQuery,
        mpsc::Sender<Result<DiscoveryEvent, DiscoveryError>>,
    )>,
    n_failing_opens: usize,
    n_opens: u64,
}

impl MemoryDiscovery {
    /// An empty store with the default limits.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store with explicit limits.
    pub fn with_limits(limits: MembershipLimits) -> Self {
        Self {
            state: Mutex::default(),
            limits,
        }
    }

    /// Publishes or replaces a card and notifies matching watches.
    pub fn put(&self, instance: ModelCardInstance) {
        let mut state = self.lock();
        state
            .cards
            .insert(instance.id.clone(), instance.card_json.clone());
        state.notify(&instance.id, DiscoveryEvent::Added(instance.clone()));
    }

    /// Withdraws a card and notifies matching watches (if it was present).
    pub fn remove(&self, id: &ModelCardInstanceId) {
        let mut state = self.lock();
        if state.cards.remove(id).is_some() {
            state.notify(id, DiscoveryEvent::Removed(id.clone()));
        }
    }

    /// Replaces a card's taints and notifies matching watches with a taint update.
    pub fn update_taints(&self, id: &ModelCardInstanceId, taints: Vec<String>) {
        let mut state = self.lock();
        let Some(card_json) = state.cards.get_mut(id) else {
            return;
        };
        if let Some(object) = card_json.as_object_mut() {
            let runtime_config = object
                .entry("runtime_config")
                .or_insert_with(|| serde_json::Value::Object(serde_json::Map::new()));
            if let Some(runtime_config) = runtime_config.as_object_mut() {
                runtime_config.insert("taints".to_owned(), serde_json::json!(taints));
            }
        }
        let event = DiscoveryEvent::TaintsUpdated {
            id: id.clone(),
            taints,
        };
        state.notify(id, event);
    }

    /// Publishes a card without telling any watch (a missed event, for reconcile tests).
    pub fn put_unannounced(&self, instance: ModelCardInstance) {
        self.lock().cards.insert(instance.id, instance.card_json);
    }

    /// Withdraws a card without telling any watch.
    pub fn remove_unannounced(&self, id: &ModelCardInstanceId) {
        self.lock().cards.remove(id);
    }

    /// Ends every open watch (as a backend failure would).
    pub fn close_watches(&self) {
        self.lock().watches.clear();
    }

    /// Makes the next `n` `list_and_watch` calls fail.
    pub fn fail_next_opens(&self, n: usize) {
        self.lock().n_failing_opens = n;
    }

    /// How many `list_and_watch` calls were made (failed ones included).
    pub fn n_opens(&self) -> u64 {
        self.lock().n_opens
    }

    fn lock(&self) -> MutexGuard<'_, MemoryState> {
        // The state stays consistent across a panic in a test thread: recover it.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn listing(state: &MemoryState, query: &DiscoveryQuery) -> Vec<ModelCardInstance> {
        state
            .cards
            .iter()
            .filter(|(id, _)| query.matches(id))
            .map(|(id, card_json)| ModelCardInstance {
                id: id.clone(),
                card_json: card_json.clone(),
            })
            .collect()
    }
}

impl MemoryState {
    fn notify(&mut self, id: &ModelCardInstanceId, event: DiscoveryEvent) {
        self.watches.retain(|(query, sender)| {
            !query.matches(id) || sender.try_send(Ok(event.clone())).is_ok()
        });
    }
}

impl Discovery for MemoryDiscovery {
    fn list<'a>(
        &'a self,
        query: &'a DiscoveryQuery,
    ) -> DiscoveryFuture<'a, Vec<ModelCardInstance>> {
        let listing = Self::listing(&self.lock(), query);
        Box::pin(async move { Ok(listing) })
    }

    fn list_and_watch<'a>(
        &'a self,
        query: &'a DiscoveryQuery,
    ) -> DiscoveryFuture<'a, (Vec<ModelCardInstance>, DiscoveryWatch)> {
        let mut state = self.lock();
        state.n_opens = state.n_opens.saturating_add(1);
        let result = if state.n_failing_opens > 0 {
            state.n_failing_opens -= 1;
            Err(DiscoveryError::Unavailable { backend: "memory" })
        } else {
            let listing = Self::listing(&state, query);
            let (sender, receiver) = mpsc::channel(self.limits.memory_watch_queue_depth.max(1));
            state.watches.push((query.clone(), sender));
            let stream = futures::stream::unfold(receiver, |mut receiver| async move {
                let item = receiver.recv().await?;
                Some((item, receiver))
            });
            Ok((listing, DiscoveryWatch::from_stream(stream)))
        };
        drop(state);
        Box::pin(async move { result })
    }
}
