#!/usr/bin/env bash
# Runs the tests that exercise a CUDA device, then the serving benchmarks, on a bare GPU host whose
# Python has torch and Triton but lacks some of sidindex's dependencies: wheels found in .whl/ and
# .whl2/ (cp312, manylinux; pip download --no-deps ... -d .whl NAME==VERSION, versions from
# constraints.txt) are installed into .site/ first, which stays for later runs on the same host.
#
#   bash bench/gpu_check.sh fetch          # here: the wheels the image lacks into .whl/ and .whl2/ (versions
#                                          # from constraints.txt) and wrk into .deb/, then `pack`
#   bash bench/gpu_check.sh pack           # here: the wheels of .whl/ and .whl2/ into one xz archive,
#                                          # .sitepack/site.tar.xz, which one call carries (with .deb/)
#   bash bench/gpu_check.sh install        # install the wheels that came along, nothing else
#   bash bench/gpu_check.sh [PYTEST ARGS]  # install what came along, then the GPU tests (test files
#                                          # named in the arguments replace the list below)
#   bash bench/gpu_check.sh check [ADS]    # the GPU tests, then bench_stream on both profiles at ADS ads
#                                          # (default 200000): the one GPU check of the serving path
#   bash bench/gpu_check.sh bench [ADS]    # then the serving benchmarks, into $OUT (or bench_out/):
#                                          # bench_topk, bench_post, bench_stream both profiles at ADS
#                                          # ads (default 2000000: about 4M SIDs), bench_host, bench_warmup,
#                                          # request_walk (the batch's path through the modules)
#   bash bench/gpu_check.sh serve [ADS]    # the server's benchmarks alone (profile_server: the engine
#                                          # under wrk, py-spy from .whl3/; bench_engine: the engine
#                                          # through its link; bench_batched: 64 requests a call; bench_load:
#                                          # process models and wrk, the large request) and profile_serving
#   bash bench/gpu_check.sh engine [ADS]   # profile_server (and its curve) and bench_engine against the
#                                          # baseline (BASELINE, or the one checkout of .baseline/), then
#                                          # bench_load's steady scenario, --workers 8, with wrk (~8 min)
#   bash bench/gpu_check.sh batched [ADS]  # bench_batched: 64 requests a call over Flight and Arrow over
#                                          # HTTP against the Retriever's own, every answer checked (default
#                                          # 1000000 ads)
#   bash bench/gpu_check.sh all [ADS]      # the tests, then the benchmarks (and bench_load's steady
#                                          # scenario with its wrk pass, one server process against
#                                          # front-end processes; wrk from .deb/: apt-get download
#                                          # wrk libluajit-5.1-2)
#
# The tests build catalogs with the CLI, which trains codebooks: faiss must be among the wheels, and
# pydantic with its needs (pydantic-core, annotated-types, typing-inspection): typer parses options with it.
# The wheels (polars, faiss and the rest) pass the 64 MiB a device call carries: packed (`pack`, without
# duckdb, which no GPU test reads) they fit, and a bare host takes one call carrying .sitepack/ and .deb/.
# Unpacked, it takes two: `install` carrying .whl/, then the check carrying .whl2/ and .deb/ (.site/ stays
# between them while the host is held). Each test's outcome and seconds, and each failure, reach
# $OUT/tests.tsv and $OUT/failures.txt as they happen (bench/test_log.py).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "fetch" ]; then  # here: the wheels the GPU image lacks, at constraints.txt's versions, and wrk
    pin() { grep -i "^$1==" constraints.txt | head -1; }
    platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
               --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    get() {  # get DIR NAME...: cp312 manylinux wheels of NAMEs at their pins, without their needs
        local dir="$1"; shift
        local pins=()
        for n in "$@"; do
            p="$(pin "$n")"
            [ -n "$p" ] || { echo "fetch: $n is not pinned in constraints.txt" >&2; exit 1; }
            pins+=("$p")
        done
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            "${platforms[@]}" -d "$dir" "${pins[@]}" || exit 1
    }
    get .whl polars polars-runtime-32 mmh3 xxhash typer rich click pydantic pydantic-core annotated-types \
        typing-inspection
    get .whl2 faiss-cpu starlette uvicorn httptools orjson pyzmq anyio cryptography cffi pycparser
    get .whl3 py-spy  # installed by pip (its binary), not packed; profile_server samples the engine with it
    mkdir -p .deb && (cd .deb && apt-get download wrk libluajit-5.1-2) || exit 1
    set -- pack
fi
if [ "${1:-}" = "pack" ]; then  # here, not on the GPU host: the wheels unzipped (what pip installs of them)
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    n=0
    for f in .whl/*.whl .whl2/*.whl; do
        case "$(basename "$f")" in duckdb-*) continue ;; esac  # no GPU test reads it, and it is large
        [ -f "$f" ] || continue
        unzip -q -o "$f" -d "$tmp" || exit 1
        n=$((n + 1))
    done
    [ "$n" -gt 0 ] || { echo "pack: no wheels in .whl/ or .whl2/" >&2; exit 1; }
    if compgen -G "$tmp/*.data" > /dev/null; then  # pip moves these; unzip does not
        echo "pack: a wheel has a .data folder ($(ls -d "$tmp"/*.data)): install it with pip instead" >&2
        exit 1
    fi
    mkdir -p .sitepack && tar cJf .sitepack/site.tar.xz -C "$tmp" . || exit 1
    echo "pack: $n wheels"; ls -l .sitepack/site.tar.xz
    exit 0
fi
site="$PWD/.site"
mkdir -p "$site"
# the wheels unpacked and packed into one archive here (.sitepack/site.tar.xz, `bench/gpu_check.sh pack`):
# xz takes them under what one call carries, so a bare host needs one call, not two
if [ -f .sitepack/site.tar.xz ]; then  # again when another archive came (the marker holds its digest)
    digest="$(sha256sum .sitepack/site.tar.xz | cut -d' ' -f1)"
    if [ "$(cat "$site/.unpacked" 2>/dev/null)" != "$digest" ]; then
        tar xJf .sitepack/site.tar.xz -C "$site" && echo "$digest" > "$site/.unpacked" || exit 1
    fi
fi
for d in .whl .whl2 .whl3; do
    if compgen -G "$d/*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$d"/*.whl \
            || exit 1
    fi
done
# .deb packages that came along (wrk and libluajit-5.1-2, for bench_load's wrk pass), unpacked beside
if compgen -G ".deb/*.deb" > /dev/null; then
    for f in .deb/*.deb; do dpkg -x "$f" "$site/deb" || exit 1; done
fi
export PATH="$site/deb/usr/bin:$PATH"
export LD_LIBRARY_PATH="$site/deb/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = "install" ]; then
    exit 0
fi
# the console script the tests run, from this checkout
mkdir -p "$site/bin"
printf '#!/usr/bin/env python3\nimport sys\nfrom sidindex_cli.app import main\nsys.exit(main())\n' > "$site/bin/sidindex"
chmod +x "$site/bin/sidindex"
export PATH="$site/bin:$PATH"
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
mode="${1:-}"
if [ "$mode" = "bench" ] || [ "$mode" = "all" ] || [ "$mode" = "serve" ] || [ "$mode" = "engine" ] \
        || [ "$mode" = "check" ] || [ "$mode" = "batched" ]; then
    shift
    case "$mode" in check) ads="${1:-200000}" ;; batched) ads="${1:-1000000}" ;; *) ads="${1:-2000000}" ;; esac
    set --
fi
out="${OUT:-bench_out}"
# the catalogs the benchmarks build stay on the host between calls, not in $OUT (which comes back)
cache="${BENCH_CACHE:-bench_cache}"
mkdir -p "$out"
export OUT="$out"
status=0
if [ "$mode" != "bench" ] && [ "$mode" != "serve" ] && [ "$mode" != "engine" ] && [ "$mode" != "batched" ]; then
    # every test file with a CUDA case (each skips them without a GPU); files named in the
    # arguments replace the list
    TESTS=(tests/test_broken_scorer.py tests/test_serving.py tests/test_retriever.py tests/test_order.py
           tests/test_swap.py tests/test_signing.py tests/test_shared_rows.py tests/test_impl.py tests/test_post.py
           tests/test_runtime.py tests/test_query_tables.py tests/test_retrieve.py
           tests/test_update.py::test_searcher_keeps_replaying_its_graphs_across_a_pause  # the rest: CPU only
           tests/test_serving_errors.py tests/test_scorer_isolation.py tests/test_shards.py tests/test_cold_start.py
           tests/test_value.py tests/test_exact_filter.py tests/test_codebook.py)
    for a in "$@"; do
        case "$a" in tests/*) TESTS=(); break ;; esac
    done
    python3 -m pytest -q -p no:cacheprovider -p bench.test_log -n 12 -o addopts="" -ra "${TESTS[@]}" "$@" \
        || status=1
fi
if [ "$mode" = "check" ]; then  # every mode on both catalogs, each checked against `runtime.retrieve`
    python3 bench/bench_stream.py --device cuda --ads "$ads" --profile both --cache "$cache" \
        --json "$out/stream.json" || status=1
fi
if [ "$mode" = "bench" ] || [ "$mode" = "all" ]; then
    python3 -m bench.bench_topk --device cuda --json "$out/topk.json" || status=1
    python3 bench/bench_post.py --device cuda --json "$out/post.json" || status=1
    python3 bench/bench_stream.py --device cuda --ads "$ads" --profile both --cache "$cache" \
        --json "$out/stream.json" || status=1
    python3 bench/bench_host.py --device cuda --ads "$ads" --cache "$cache" --json "$out/host.json" || status=1
    python3 bench/bench_warmup.py --device cuda --ads "$ads" --cache "$cache" --json "$out/warmup.json" || status=1
    python3 bench/request_walk.py --device cuda --ads "$ads" --cache "$cache" > "$out/walk.txt" || status=1
fi
if [ "$mode" = "bench" ] || [ "$mode" = "all" ] || [ "$mode" = "serve" ] || [ "$mode" = "engine" ]; then
    # where the engine process's time goes under wrk (py-spy from .whl3/, when it came), against
    # another checkout's packages served on the same catalog in the same run, when they came: those
    # of $BASELINE, else of .baseline itself or of the one checkout under it (`git archive REV runtime
    # sidindex sidindex_cli schemas pipelines | tar x -C .baseline/REV`); with several, name one
    base="${BASELINE:-}"
    if [ -z "$base" ] && [ -f .baseline/runtime/__init__.py ]; then
        base=.baseline
    elif [ -z "$base" ]; then
        found=(.baseline/*/runtime/__init__.py)
        if [ "${#found[@]}" -eq 1 ] && [ -f "${found[0]}" ]; then
            base="$(dirname "$(dirname "${found[0]}")")"
        elif [ -f "${found[0]}" ]; then
            echo "gpu_check: several checkouts under .baseline; BASELINE=.baseline/REV picks one (none used)" >&2
        fi
    fi
    baseline=()
    [ -n "$base" ] && baseline=(--baseline "$base")
    # the host's default front-ends (its cores less two) at 128 connections, then at 64, 256 and 512:
    # where more connections stop adding requests/s, the server, not wrk's closed loop, bounds it
    python3 bench/profile_server.py --device cuda --ads "$ads" --workers 14 --connections 128 --curve 64,256,512 \
        --seconds 10 "${baseline[@]}" \
        --cache "$cache" --json "$out/profile_server.json" || status=1
    # the engine alone through its link (no HTTP): requests/s, the link's and the process's CPU per request
    # (four client processes: one, near fully busy, bounded what it measured)
    python3 bench/bench_engine.py --device cuda --ads "$ads" --beams 1,512,1024,1024 --runs 3 --requests 8000 \
        --clients 4 --window 128 "${baseline[@]}" --cache "$cache" --json "$out/engine.json" || status=1
fi
if [ "$mode" = "engine" ]; then  # and the front-end processes' answers checked under load, with wrk beside
    python3 bench/bench_load.py --device cuda --ads "$ads" --scenarios steady --rate 10000 --clients 64 --procs 4 \
        --max-batch 64 --seconds 10 --wrk-connections 64 --workers 8 --cache "$cache" \
        --json "$out/load.json" || status=1
fi
if [ "$mode" = "batched" ] || [ "$mode" = "serve" ]; then  # callers that batch: 64 requests a call
    python3 bench/bench_batched.py --device cuda --ads "$ads" --rows 64 --clients 32 --procs 4 --workers 8 \
        --cache "$cache" --json "$out/batched.json" || status=1
fi
if [ "$mode" = "bench" ] || [ "$mode" = "all" ] || [ "$mode" = "serve" ]; then
    # the server under load, the default profile's catalog from above, and wrk beside it: one process,
    # then front-end processes over the engine (the clients take the host's other cores)
    python3 bench/bench_load.py --device cuda --ads "$ads" --scenarios steady --rate 10000 --clients 64 --procs 4 \
        --max-batch 64 --seconds 10 --wrk-connections 64 --workers 1,8 --cache "$cache" \
        --json "$out/load.json" || status=1
    # fairness: a 4,096-request body beside a load the server sustains
    python3 bench/bench_load.py --device cuda --ads "$ads" --scenarios large --rate 1000 --clients 64 --procs 2 \
        --max-batch 64 --seconds 10 --workers 8 --no-wrk --cache "$cache" --json "$out/load_large.json" \
        || status=1
    # the skewed catalog (bulk advertisers' near-duplicates under a few SIDs) under the same load
    python3 bench/bench_load.py --device cuda --ads "$ads" --profile skewed --scenarios steady --rate 10000 \
        --clients 64 --procs 4 --max-batch 64 --seconds 10 --workers 8 --no-wrk --cache "$cache" \
        --json "$out/load_skewed.json" || status=1
    python3 bench/profile_serving.py --ads "$ads" --cache "$cache" --json "$out/profile.json" || status=1
fi
exit $status
