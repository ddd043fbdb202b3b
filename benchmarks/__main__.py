import sys

if sys.argv[1:2] == [
    "gpu"
]:  # python -m benchmarks gpu [options]: the single-GPU tables (benchmarks/gpu.py)
    from .gpu import main as gpu_main

    sys.exit(gpu_main(sys.argv[2:]))

if sys.argv[1:2] == ["stages"]:  # python -m benchmarks stages [options]: the stage profile
    from .stages import main as stages_main

    sys.exit(stages_main(sys.argv[2:]))

if sys.argv[1:2] == [
    "scale"
]:  # python -m benchmarks scale [options]: the planner at scale, from plans alone
    from .scale import main as scale_main

    sys.exit(scale_main(sys.argv[2:]))

if sys.argv[1:2] == [
    "stacking"
]:  # python -m benchmarks stacking [options]: NS per matrix or stacked
    from .stacking import main as stacking_main

    sys.exit(stacking_main(sys.argv[2:]))

if sys.argv[1:2] == ["collectives"]:  # python -m benchmarks collectives [options]: gloo latencies
    from .collectives import main as collectives_main

    sys.exit(collectives_main(sys.argv[2:]))

if sys.argv[1:2] == [
    "elementwise"
]:  # python -m benchmarks elementwise: position-free stages, measured
    from .elementwise import main as elementwise_main

    sys.exit(elementwise_main(sys.argv[2:]))

if sys.argv[1:2] == [
    "sites"
]:  # python -m benchmarks sites [options]: the memory peak by allocation site
    from .sites import main as sites_main

    sys.exit(sites_main(sys.argv[2:]))

if sys.argv[1:2] == [
    "one-rank"
]:  # python -m benchmarks one-rank [options]: one rank's step, contract by contract
    from .one_rank import main as one_rank_main

    sys.exit(one_rank_main(sys.argv[2:]))

from .run import main

sys.exit(main())
