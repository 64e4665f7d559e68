//! `kvrelay inspect membership`: project a directory of card files into endpoint
//! memberships and print them as JSON.
//!
//! Output: a pretty JSON array sorted by endpoint; per endpoint `endpoint`
//! (`ns.component.name`), `generation`, `materializable`, `domain` (or null),
//! `registrations` (`model`, `target`, `aliases`), `models`, `aliases`, `roles` and
//! `conflicts` (`scope`, `subject`, `reason`). Skipped files and soft errors go to stderr.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;
use kvrelay_identity::{ModelTarget, WorkerRole};
use kvrelay_membership::{
    DiscoveryScope, EndpointMembership, MembershipLimits, MembershipProjection, MembershipView,
    read_card_dir,
};
use serde::Serialize;

use crate::usage::usage;

/// Arguments of `kvrelay inspect membership`.
#[derive(Debug, clap::Args)]
pub(crate) struct MembershipArgs {
    /// Directory of card files (one discovery record per file, as the file backend reads).
    #[arg(long, value_name = "DIR")]
    cards: PathBuf,
    /// A namespace to watch (repeatable).
    #[arg(long = "namespace", value_name = "NS")]
    namespaces: Vec<String>,
    /// Keep only endpoints under `ns[.component[.endpoint]]` (repeatable).
    #[arg(long = "endpoint-prefix", value_name = "P")]
    endpoint_prefixes: Vec<String>,
    /// Watch every namespace.
    #[arg(long)]
    watch_all: bool,
}

pub(crate) fn run(args: &MembershipArgs) -> Result<()> {
    let scope = DiscoveryScope {
        namespaces: args.namespaces.clone(),
        endpoint_prefixes: args.endpoint_prefixes.clone(),
        watch_all: args.watch_all,
    };
    scope
        .validate()
        .map_err(|error| usage(format!("{error} (use --namespace NS or --watch-all)")))?;
    let listing = read_card_dir(&args.cards, &MembershipLimits::default())
        .map_err(|error| usage(error.to_string()))?;
    for (path, error) in &listing.skipped {
        eprintln!("warning: skipped {}: {error}", path.display());
    }
    let queries = scope.queries();
    let instances = listing
        .instances()
        .into_iter()
        .filter(|instance| queries.iter().any(|query| query.matches(&instance.id)))
        .collect();
    let mut projection = MembershipProjection::new(scope.filter());
    projection.replace_all(instances);
    projection.project();
    while let Some(diagnostic) = projection.poll_diagnostic() {
        eprintln!("warning: {diagnostic}");
    }
    let json = serde_json::to_string_pretty(&render(&projection.view()))?;
    let mut stdout = std::io::stdout().lock();
    match writeln!(stdout, "{json}") {
        // A closed pipe (`| head`) is the reader's choice, not an error.
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}

#[derive(Debug, Serialize)]
struct EndpointJson {
    endpoint: String,
    generation: u64,
    materializable: bool,
    domain: Option<DomainJson>,
    registrations: Vec<RegistrationJson>,
    models: Vec<String>,
    aliases: Vec<String>,
    roles: Vec<WorkerRole>,
    conflicts: Vec<ConflictJson>,
}

#[derive(Debug, Serialize)]
struct DomainJson {
    indexer_domain: String,
    kv_block_size: u32,
    hash_format: kvrelay_identity::KvQueryHashFormat,
}

#[derive(Debug, Serialize)]
struct RegistrationJson {
    model: String,
    target: TargetJson,
    aliases: Vec<String>,
}

#[derive(Debug, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum TargetJson {
    Base { base_model: String },
    Lora { base_model: String, adapter: String },
}

#[derive(Debug, Serialize)]
struct ConflictJson {
    scope: &'static str,
    subject: String,
    reason: String,
}

fn render(view: &MembershipView) -> Vec<EndpointJson> {
    view.endpoints().map(render_endpoint).collect()
}

fn render_endpoint(membership: &EndpointMembership) -> EndpointJson {
    EndpointJson {
        endpoint: membership.endpoint.dotted(),
        generation: membership.generation,
        materializable: membership.is_materializable(),
        domain: membership.domain.map(|domain| DomainJson {
            indexer_domain: domain.id.to_string(),
            kv_block_size: domain.query_semantics.kv_block_size(),
            hash_format: domain.query_semantics.hash_format(),
        }),
        registrations: membership
            .registrations
            .iter()
            .map(|registration| RegistrationJson {
                model: registration.model().to_string(),
                target: match registration.target() {
                    ModelTarget::Base { base_model } => TargetJson::Base {
                        base_model: base_model.to_string(),
                    },
                    ModelTarget::Lora {
                        base_model,
                        adapter,
                    } => TargetJson::Lora {
                        base_model: base_model.to_string(),
                        adapter: adapter.to_string(),
                    },
                },
                aliases: registration
                    .aliases()
                    .iter()
                    .map(ToString::to_string)
                    .collect(),
            })
            .collect(),
        models: membership.models.iter().map(ToString::to_string).collect(),
        aliases: membership.aliases.iter().map(ToString::to_string).collect(),
        roles: membership.roles.clone(),
        conflicts: membership
            .conflicts
            .iter()
            .map(|conflict| ConflictJson {
                scope: conflict.scope.as_str(),
                subject: conflict.subject.to_string(),
                reason: conflict.reason.to_string(),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use kvrelay_membership::{EndpointFilter, read_card_dir};

    use super::*;

    fn example_view() -> MembershipView {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/deployment/cards");
        let listing = read_card_dir(&dir, &MembershipLimits::default()).unwrap();
        assert!(listing.skipped.is_empty(), "{:?}", listing.skipped);
        let mut projection = MembershipProjection::new(EndpointFilter::default());
        projection.replace_all(listing.instances());
        projection.project();
        projection.view()
    }

    #[test]
    fn example_deployment_projects_without_conflicts() {
        let rendered = render(&example_view());
        assert!(rendered.len() >= 3);
        for endpoint in &rendered {
            assert!(endpoint.materializable, "{}", endpoint.endpoint);
            assert!(endpoint.conflicts.is_empty(), "{}", endpoint.endpoint);
            assert_eq!(endpoint.domain.as_ref().unwrap().kv_block_size, 16);
        }
    }

    #[test]
    fn example_deployment_json_has_the_documented_fields() {
        let json = serde_json::to_value(render(&example_view())).unwrap();
        let first = &json[0];
        for field in [
            "endpoint",
            "materializable",
            "domain",
            "registrations",
            "models",
            "aliases",
            "roles",
            "conflicts",
        ] {
            assert!(first.get(field).is_some(), "missing {field}");
        }
        let has_lora = json.as_array().unwrap().iter().any(|endpoint| {
            endpoint["registrations"]
                .as_array()
                .unwrap()
                .iter()
                .any(|registration| registration["target"]["kind"] == "lora")
        });
        assert!(has_lora);
    }
}
