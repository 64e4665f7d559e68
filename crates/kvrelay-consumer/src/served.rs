//! The base models a catalog serves, with the KV block size their requests are hashed
//! with: what a router enumerates to score a request against every model it could mean.

use kvrelay_codec::v1::CatalogUpdate;

/// A base model some pool of a catalog serves (LoRA adapters are not base models).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServedModel {
    /// The registration's model name.
    pub model: String,
    /// Tokens per KV block of the pool serving it.
    pub kv_block_size: u32,
}

/// Every base model served by some pool of `catalog`, sorted, each `(model, block size)`
/// pair once (one model served at two block sizes appears twice).
pub fn served_base_models(catalog: &CatalogUpdate) -> Vec<ServedModel> {
    let mut models: Vec<ServedModel> = catalog
        .pools
        .iter()
        .flat_map(|pool| {
            pool.registrations
                .iter()
                .filter(|registration| registration.adapter.is_none())
                .map(|registration| ServedModel {
                    model: registration.model.clone(),
                    kv_block_size: pool.query_semantics.kv_block_size,
                })
        })
        .collect();
    models.sort();
    models.dedup();
    models
}
