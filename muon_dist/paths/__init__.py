"""One module per communication path. Each `run` maps this rank's shards of a batch's directions to this
rank's shards of their orthogonalised updates, calling `kernel` (muon_ref's, passed in) on whole matrices.
global_all_to_all takes a batch of params of any layouts (one layout and kernel per param, and their owners),
so it is called directly, not through RUNNERS."""

from . import agrs, all_to_all, global_all_to_all, local, padded_all_to_all, replicated, subgroup_all_gather

RUNNERS = {
    "all_to_all": all_to_all.run,
    "agrs": agrs.run,
    "padded_all_to_all": padded_all_to_all.run,
    "replicated": replicated.run,
    "local": local.run,
    "subgroup_all_gather": subgroup_all_gather.run,
}
