// The real node's cluster DNS: CoreDNS with only the plugins its Corefile
// (hack/realnode/node) names, built as CoreDNS documents for a chosen set of
// plugins: a main package that imports coremain and each plugin, whose init
// registers it. github.com/coredns/coredns's own main imports all of its ~60
// plugins, the cloud DNS providers' SDKs (AWS, Azure, Google) among them, and
// was one of the longest cold builds here. A Corefile that names a plugin not
// imported below fails at start with "unknown directive".
package main

import (
	_ "github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
)

func main() {
	coremain.Run()
}
