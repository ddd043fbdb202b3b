"""One module per communication path. Each `run` maps this rank's shards of a batch's directions to this
rank's shards of their orthogonalised updates, calling `kernel` (muon_ref's, passed in) on whole matrices."""

from . import agrs, all_to_all, local, padded_all_to_all, replicated, subgroup_all_gather

RUNNERS = {
    "all_to_all": all_to_all.run,
    "agrs": agrs.run,
    "padded_all_to_all": padded_all_to_all.run,
    "replicated": replicated.run,
    "local": local.run,
    "subgroup_all_gather": subgroup_all_gather.run,
}
