#!/usr/bin/env bash
# Builds the test cluster's binaries from the pinned Go modules beside this
# script, once, into a cache outside the clone, and prints that bin directory.
#
# Each tool set is its own module (kubernetes/, etcd/, kwok/, helm/, for
# the real node coredns/, local-path/ and kube-router/, and prometheus/: Debian's
# Prometheus has no Kubernetes service discovery) because
# their dependency graphs conflict: helm v3.22 wants the v0.37 client
# libraries, Kubernetes v1.36.3 replaces them with v0.36.3, and etcd and kwok
# pin other gRPC and OpenTelemetry versions. One module would let Go's minimum
# version selection rebuild every tool against dependencies it was never
# released with.
#
# The cache key hashes the modules and this script, so a change to either
# builds a new directory. The marker file .complete is written last: a build
# that was interrupted has no marker and is redone from scratch (Go's own
# caches, kept under $KUBETRAIN_CACHE/go, make the redo cheaper).
#
#   hack/tools/build.sh            build if needed; print the bin directory
#   hack/tools/build.sh --check    print the bin directory if built, else fail
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${KUBETRAIN_CACHE:-$HOME/.cache/kubetrain}
go_min_minor=26 # the go.mod files say `go 1.26.0`, prometheus/ `go 1.26.7`
go_min_patch=7

# Kubernetes stamps its version into two packages; `kubectl version` reads
# client-go's, the servers read component-base's.
k8s_version=v1.36.3
k8s_build_date=2026-07-22T18:07:38Z # the tag's date, so rebuilds are identical
k8s_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=36"
  k8s_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$k8s_build_date"
done
etcd_ldflags="-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=v3.6.16"
# kwokctl derives the default Kubernetes version of a cluster from KubeVersion.
kwok_ldflags="-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=0.8.0 -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=1.36.3"
# helm's `kubeVersion` checks (lint, template) use the client-go minor it
# was built with: helm v3.22 is built with client-go v0.37, hence 1.37.
helm_ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=v3.22.0"
helm_ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  helm_ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=37"
done

# CoreDNS stamps only its commit; local-path-provisioner prints VERSION.
coredns_ldflags="-s -w -X github.com/coredns/coredns/coremain.GitCommit=v1.14.7"
local_path_ldflags="-s -w -X main.VERSION=v0.0.30"
# kube-router: only its firewall (NetworkPolicy) controller runs, on the real node.
kube_router_ldflags="-s -w -X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version=v2.1.0"
# Prometheus v3.16.0 is module version v0.316.0. Its build tags leave out
# every service discovery but Kubernetes' (the cloud SDKs): 3.5 min cold
# instead of about 9.
prometheus_ldflags="-s -w -X github.com/prometheus/common/version.Version=3.16.0"
prometheus_ldflags+=" -X github.com/prometheus/common/version.Branch=v3.16.0"
prometheus_tags="remove_all_sd,enable_kubernetes_sd"

# Two build streams run side by side, each a list of units built one after the other:
#   name[,name...] | module directory | main package[ package...] | ldflags variable [| build tags]
# A unit of several packages is one `go build -o bin/` (the binaries are named after the
# packages), so one binary links while the next compiles. Two streams rather than one: a
# single `go build` leaves a core idle while it downloads modules, links, or compiles a package
# nothing else waits on; the second stream fills those gaps (docs/test-cluster.md has the cold
# times). The streams are balanced by their cold compile times one after the other.
stream_a=(
  "kube-apiserver,kube-controller-manager,kube-scheduler,kubectl,kubelet,kube-proxy|kubernetes|k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy|k8s_ldflags"
  "etcd|etcd|go.etcd.io/etcd/server/v3|etcd_ldflags"
  "helm|helm|helm.sh/helm/v3/cmd/helm|helm_ldflags"
  "kube-router|kube-router|github.com/cloudnativelabs/kube-router/v2/cmd/kube-router|kube_router_ldflags"
)
stream_b=(
  "kwok,kwokctl|kwok|sigs.k8s.io/kwok/cmd/kwok sigs.k8s.io/kwok/cmd/kwokctl|kwok_ldflags"
  "coredns|coredns|kubetrain/hack/tools/coredns|coredns_ldflags"
  "local-path-provisioner|local-path|github.com/rancher/local-path-provisioner|local_path_ldflags"
  "prometheus|prometheus|github.com/prometheus/prometheus/cmd/prometheus|prometheus_ldflags|$prometheus_tags"
)

say() { echo "hack/tools/build.sh: $*" >&2; }

key=$(cd "$here" && find . -type f \( -name go.mod -o -name go.sum -o -name '*.go' -o -name build.sh \) \
  | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
dir="$cache/tools/$key"
bin="$dir/bin"

if [ -f "$dir/.complete" ]; then
  echo "$bin"
  exit 0
fi
if [ "${1:-}" = "--check" ]; then
  say "the tools are not built ($dir/.complete missing); run hack/cluster build"
  exit 1
fi

# GOTOOLCHAIN=local: an old Go must fail here rather than download another.
if ! command -v go >/dev/null; then
  say "go not found on PATH: install Go 1.$go_min_minor or newer (https://go.dev/dl/) to build the test cluster's tools"
  exit 1
fi
go_version=$(GOTOOLCHAIN=local go env GOVERSION)
minor=$(echo "$go_version" | sed -nE 's/^go1\.([0-9]+).*/\1/p')
patch=$(echo "$go_version" | sed -nE 's/^go1\.[0-9]+\.([0-9]+).*/\1/p')
if [ -z "$minor" ] || [ "$minor" -lt "$go_min_minor" ] \
  || { [ "$minor" -eq "$go_min_minor" ] && [ "${patch:-0}" -lt "$go_min_patch" ]; }; then
  say "found $go_version; the test cluster's tools need Go 1.$go_min_minor.$go_min_patch or newer (https://go.dev/dl/)"
  exit 1
fi

export GOTOOLCHAIN=local CGO_ENABLED=0
export GOMODCACHE="$cache/go/mod" GOCACHE="$cache/go/build"
# -dwarf=false: the compiler writes no debug information, which -ldflags -w would strip
# from the binaries anyway. The binaries are the same size; the compile takes about 10 %
# less CPU (etcd from an empty build cache, user+sys: 165 and 148 s with DWARF, 152 and
# 133 s without, runs alternated; GOGC=400 on top gave nothing steady: 146 and 138 s).
export GOFLAGS="-mod=readonly -trimpath -buildvcs=false -gcflags=all=-dwarf=false"
mkdir -p "$cache/tools" "$GOMODCACHE" "$GOCACHE"

# Two builds at once (a developer and CI on one machine) would clobber each
# other's bin directory: the second waits, then finds the marker.
exec 9>"$dir.lock"
if ! flock -n 9; then
  say "another build of $key is running; waiting for it"
  flock 9
fi
if [ -f "$dir/.complete" ]; then
  echo "$bin"
  exit 0
fi

rm -rf "$dir"
mkdir -p "$bin"
start=$SECONDS
say "building the test cluster's tools with $go_version into $dir (cold: about 25 minutes on a quiet 2-core machine)"

# One stream: for each unit, download its module's dependencies, then build it, with a
# heartbeat (kube-apiserver alone compiles for several silent minutes). Exits non-zero at the
# first failure.
build_stream() {
  local label=$1 unit names module pkgs flags_var tags t pid beat out
  shift
  for unit in "$@"; do
    IFS='|' read -r names module pkgs flags_var tags <<<"$unit"
    t=$SECONDS
    (cd "$here/$module" && go mod download) || { say "[$label] go mod download in $module failed"; return 1; }
    say "[$label] $names: modules downloaded ($((SECONDS - t)) s, total $((SECONDS - start)) s); building"
    # One package: -o names the file; several: -o names the directory, each binary after its package.
    if [[ $names == *,* ]]; then out="$bin/"; else out="$bin/$names"; fi
    # shellcheck disable=SC2086 # $pkgs is a list of packages
    (cd "$here/$module" && go build -tags "${tags:-}" -ldflags "${!flags_var}" -o "$out" $pkgs) &
    pid=$!
    beat=$((SECONDS + 60))
    while kill -0 "$pid" 2>/dev/null; do
      sleep 1
      if [ "$SECONDS" -ge "$beat" ]; then
        say "[$label]       $names still compiling ($((SECONDS - t)) s, total $((SECONDS - start)) s)"
        beat=$((beat + 60))
      fi
    done
    if ! wait "$pid"; then
      say "[$label] go build of $names ($pkgs) failed; $dir stays incomplete and is rebuilt next time"
      return 1
    fi
    for name in ${names//,/ }; do
      [ -x "$bin/$name" ] || { say "[$label] go build of $names wrote no $bin/$name"; return 1; }
    done
    say "[$label] $names done ($((SECONDS - t)) s, total $((SECONDS - start)) s)"
  done
}

# Ctrl-C reaches both streams and their `go build`s (one process group); any other exit
# before both are waited for kills the streams.
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
build_stream a "${stream_a[@]}" &
pid_a=$!
build_stream b "${stream_b[@]}" &
pid_b=$!
# Both are waited for, so that a failed stream does not leave the other writing into $dir.
rc=0
wait "$pid_a" || rc=1
wait "$pid_b" || rc=1
if [ "$rc" -ne 0 ]; then
  say "a build stream failed (above); $dir stays incomplete and is rebuilt next time"
  exit 1
fi

trap - EXIT
du -sh "$bin" | awk '{print "binaries: " $1}' >&2
date -u +%Y-%m-%dT%H:%M:%SZ >"$dir/.complete"
say "done in $((SECONDS - start)) s"
echo "$bin"
