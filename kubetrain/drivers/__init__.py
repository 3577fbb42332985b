"""The engine's two drivers, independent of each other: `cluster` (the kopf operator, `kubetrain operator`)
runs a job's plan as Kubernetes objects, `local` (`kubetrain run`) as processes on this machine. Each feeds
the engine (kubetrain.engine) what it observes and carries out what the engine decides."""
