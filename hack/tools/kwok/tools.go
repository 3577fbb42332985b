//go:build tools

// Package tools names the main packages built from this module, so that
// `go mod tidy` keeps their dependencies (and go.sum) pinned.
package tools

import (
	_ "sigs.k8s.io/kwok/cmd/kwok"
	_ "sigs.k8s.io/kwok/cmd/kwokctl"
)
