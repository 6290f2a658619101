# Benchmarks of the one-node mount (see benchmarks/README.md). Needs root and /dev/fuse.
PYTHON ?= .venv/bin/python

.PHONY: bench bench-quick

# Full set: 2 GiB I/O, 1 GiB DCP and backup, 1 and 8 GiB RSS (about 6-7 minutes).
bench:
	$(PYTHON) -m benchmarks.run

# Small sizes, no 8 GiB run (under 2 minutes).
bench-quick:
	$(PYTHON) -m benchmarks.run --quick

# Recovery at the speed of the wire (benchmarks/bench_recovery.py, issue 41): 3 nodes,
# replicas=2, 1 GiB, against a plain TCP copy; ARGS="--tls", or ARGS="--shaped 1,2,3
# --size 512M" for the restore over tc-shaped links (1 Gbit/s per holder, needs root), or
# ARGS="--job-restore" for the whole job restored from a file:// bucket (4 nodes, D=2).
.PHONY: bench-recovery
bench-recovery:
	$(PYTHON) -m benchmarks.bench_recovery $(ARGS)

# The peer tier (benchmarks/bench_peer.py): bare grpc stream, PeerClient, two daemons.
# make bench-peer ARGS="--size 256M --only baseline,client"
.PHONY: bench-peer
bench-peer:
	$(PYTHON) -m benchmarks.bench_peer $(ARGS)

# Metadata ops/s (benchmarks/bench_namespace.py): tmpfs, the no-op FUSE ceiling (noop,
# noop-x), one mount (node; node-base with --base DIR), a 4-node scope=job namespace on a
# 1-member etcd it starts (etcd-rank0, etcd-member, etcd-4x, etcd-8w); about 20 minutes at
# --ops 400, mostly etcd. Pick engines or targets:
# make bench-namespace ARGS="--ops 200 --engines etcd"  or  ARGS="--only node,etcd-member"  or  ARGS="--base DIR" (node-base: the code in DIR)
.PHONY: bench-namespace
bench-namespace:
	$(PYTHON) -m benchmarks.bench_namespace $(ARGS)

# Many small files (benchmarks/bench_files.py): 100,000 files created, listed, read back,
# remounted and read again; tmpfs baseline, daemon RSS and descriptors (a few minutes).
# make bench-files ARGS="--files 20000 --nofile 256"
.PHONY: bench-files
bench-files:
	$(PYTHON) -m benchmarks.bench_files $(ARGS)

# Orbax multi-tier checkpointing (benchmarks/bench_mtc.py): 2 daemons with mount option mtc,
# restart to the restore marker from a peer and from file://, bytes between data-parallel
# replicas (about 6 minutes at 1 GiB per node, 3 repeats).
# make bench-mtc ARGS="--gib 0.25 --reps 1"
.PHONY: bench-mtc
bench-mtc:
	$(PYTHON) -m benchmarks.bench_mtc $(ARGS)

# Close -> sealed of a large file against blake3's own rate with the same threads
# (benchmarks/bench_seal.py, issue 40): blake3 over a tmpfs file, hash_fd, and a mount's seal.
# make bench-seal ARGS="--sizes 1G,4G --threads 1,4 --reps 3"
.PHONY: bench-seal
bench-seal:
	$(PYTHON) -m benchmarks.bench_seal $(ARGS)

# Chaos run (examples/chaos.py, docs/reliability.md): 4 daemons on loopback, scope=node then
# scope=job, a DCP-style save loop and a seeded schedule of faults (kill -9 with replacement,
# SIGSTOP, partitions, corrupted chunks in every tier, backup outages); prints a table per
# scope and exits 1 on any invariant violation (30 faults per scope: 5-10 minutes).
# make chaos ARGS="--seed 7 --scope job --minutes 20"
.PHONY: chaos
chaos:
	$(PYTHON) examples/chaos.py $(ARGS)

# The scale run (benchmarks/bench_scale.py, issue 42): N real daemons, each in a network
# namespace of its own on one bridge, one etcd; join, saves, a replacement, a whole-job restart.
# make bench-scale ARGS="--nodes 8,32,64 --scopes node,job"
.PHONY: bench-scale
bench-scale:
	$(PYTHON) -m benchmarks.bench_scale $(ARGS)

# Coordination at scale (benchmarks/bench_coord_scale.py, issue 13): many light members in one
# process against one local etcd (no FUSE): join, rest, save, restart-and-decide at 64 and
# 1,000 members (about 4 minutes).
# make bench-coord-scale ARGS="--members 64 --rest-s 10"
.PHONY: bench-coord-scale
bench-coord-scale:
	$(PYTHON) -m benchmarks.bench_coord_scale $(ARGS)

# Fuzz tests, long form (docs/fuzzing.md): tests/t1_fuzz_parsers_test.py (mount options,
# replicator.yaml, step manifests) and tests/t2_fuzz_peer_test.py (a Peer server fed hostile
# messages) with FUZZ_EXAMPLES random inputs per test (20,000: about 30 minutes on 2 cores; the
# test suite runs a short, derandomized form). A failure prints the input and a
# @reproduce_failure blob. make fuzz FUZZ_EXAMPLES=2000 ARGS="--hypothesis-seed=7 -x"
FUZZ_EXAMPLES ?= 20000
.PHONY: fuzz
fuzz:
	MTCFS_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PYTHON) -m pytest -q --timeout 0 -o session_timeout=86400 \
		tests/t1_fuzz_parsers_test.py tests/t2_fuzz_peer_test.py $(ARGS)

# Beyond the FUSE ceiling (benchmarks/bench_passthrough.py, docs/passthrough.md, issue 18): 1 MiB
# sequential write + seal and cold/warm reads of 256 MiB and 1 GiB on tmpfs, a Python /dev/fuse
# server with kernel passthrough (and without), the no-op pyfuse3 ceiling and a one-node mtcfs
# mount, 3 repeats (about 3 minutes). make bench-passthrough ARGS="--sizes 1G --reps 5"
.PHONY: bench-passthrough
bench-passthrough:
	$(PYTHON) -m benchmarks.bench_passthrough $(ARGS)

# Random writes and library saves (benchmarks/bench_random.py, issue 18): 2 x 512 MiB written
# in 4 KiB-1 MiB blocks at random offsets (Python job, verified; and fio if installed),
# torch.save of 500 MiB, safetensors save_file of 332 MiB, on tmpfs, the no-op FUSE ceiling
# and one mtcfs node, with the daemons' CPU per MiB (3 repeats: about 3 minutes).
# make bench-random ARGS="--size 256M --reps 5 --only rand,fio"  (--cached: also mtcfs with
# direct_writes=no)
.PHONY: bench-random
bench-random:
	$(PYTHON) -m benchmarks.bench_random $(ARGS)

# RAM-disk speed, issue 40's "Measured" table in one run (benchmarks/bench_ramdisk.py): tmpfs,
# mtcfs (passthrough) and mtcfs passthrough=no on /dev/shm; sequential write/cold/warm read of
# 1 and 4 GiB, first read after a restart, close -> sealed vs blake3, torch.save, save_file,
# DCP and Orbax saves, the issue's fio jobs, daemon CPU per GiB; ratios with PASS/MISS.
# make bench-ramdisk ARGS="--reps 5"  or  ARGS="--no-4g --reps 1 --only seq,first,seal"
RAMDISK_REPS ?= 3
.PHONY: bench-ramdisk
bench-ramdisk:
	$(PYTHON) -m benchmarks.bench_ramdisk --sizes 1G,4G --reps $(RAMDISK_REPS) $(ARGS)

# What direct writes cost small writers (benchmarks/bench_write_sizes.py): a thread's first
# and next new file written in unbuffered write(2)s of 4 KiB to 8 MiB on tmpfs, the no-op,
# mtcfs and mtcfs with direct_writes=no (about 3 minutes).
# make bench-write-sizes ARGS="--base DIR"  (mtcfs-base: the code of the tree in DIR)
.PHONY: bench-write-sizes
bench-write-sizes:
	$(PYTHON) -m benchmarks.bench_write_sizes $(ARGS)

# Small writers beside large ones (benchmarks/bench_small_writers.py): GNU tar -x, torch.save
# of 6,000 small tensors and of 62 large ones, on tmpfs, the no-op, mtcfs and mtcfs with
# direct_writes=no (about 3 minutes). ARGS="--base DIR" as above.
.PHONY: bench-small-writers
bench-small-writers:
	$(PYTHON) -m benchmarks.bench_small_writers $(ARGS)

# Rewrites of sealed files (benchmarks/bench_rewrite.py, issue 18): 1-byte rewrites of sealed
# 1 and 2 GiB sparse and dense files on tmpfs, on a mount running BASE's code (before) and on
# one running this tree (after): wall, daemon CPU, bytes hashed, RAM growth; about 3 minutes.
# make bench-rewrite ARGS="--sizes 1G --reps 5 --base /path/to/old/tree"
# make bench-rewrite ARGS="--scope job --kinds sparse,dense,dense+reader --base /path/to/old/tree"
.PHONY: bench-rewrite
bench-rewrite:
	$(PYTHON) -m benchmarks.bench_rewrite $(ARGS)

# Cold reads of several code trees in one run (benchmarks/bench_ab.py), for before/after:
# git worktree add /tmp/before <rev>; make bench-ab ARGS="--tree before=/tmp/before --tree after=."
.PHONY: bench-ab
bench-ab:
	$(PYTHON) -m benchmarks.bench_ab $(ARGS)

# How long the FUSE loop stops while a large file's data is freed (benchmarks/bench_free.py):
# make bench-free ARGS="--tree before=/tmp/before --tree after=."
.PHONY: bench-free
bench-free:
	$(PYTHON) -m benchmarks.bench_free $(ARGS)

# Background work against training on the same host (benchmarks/bench_interference.py): a
# 1-thread torch trainer beside 2 daemons on loopback (replicas=1, rank 0 backed up to
# file:// at every checkpoint); its step times idle and while one 1.5 GiB torch.save is
# sealed, replicated and backed up, per setting (none, default, nice, pinned, rate;
# plain, and the controls tmpfs and hog), 2 repeats interleaved (about 6 minutes).
# make bench-interference ARGS="--size 512M --reps 1 --settings plain,none --png /tmp/i.png"
.PHONY: bench-interference
bench-interference:
	$(PYTHON) -m benchmarks.bench_interference $(ARGS)

# FUSE request latency on a host whose CPUs are all busy, while a file is sealed, per
# budget setting (benchmarks/bench_busy_latency.py; docs/benchmarks.md, issue 45).
.PHONY: bench-busy-latency
bench-busy-latency:
	$(PYTHON) -m benchmarks.bench_busy_latency $(ARGS)

# The node image built here from Debian's archive (scripts/build-image.sh), and the
# DaemonSet's pod run from it by podman as the kubelet would (tests/t9_container_test.py,
# docs/kubernetes.md "The image and the pod, run here"; about 10 minutes, most of it the build).
.PHONY: image test-container
image:
	bash scripts/build-image.sh

test-container:
	$(PYTHON) -m pytest -k container -n 0 -p no:randomly tests/t9_container_test.py
