//go:build tools

// Package tools names the main package built from this module, so that
// `go mod tidy` keeps its dependencies (and go.sum) pinned.
package tools

import _ "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"
