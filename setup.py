"""Maps the design's folders (operator/, trainer/, cli/, bench/) onto import packages.

The folder `operator/` can never be imported under that name (the standard
library owns `operator`), so the packages are `kubetrain_operator`,
`kubetrain_trainer`, `kubetrain_cli` and `kubetrain_bench`. Everything else
lives in pyproject.toml.
"""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent

# `kubetrain` is the small public API of users' own training scripts (import kubetrain); `kubetrain_cli`
# the `kubetrain` command; `kubetrain_bench` the benchmarks of `kubetrain bench`; `kubetrain_contract`
# what the operator, the local backend and the trainer share.
FOLDERS = {"kubetrain_contract": "contract", "kubetrain_operator": "operator", "kubetrain_trainer": "trainer",
           "kubetrain": "kubetrain", "kubetrain_cli": "cli", "kubetrain_bench": "bench"}
# The benchmarks are development tools: the images' Dockerfiles do not copy bench/, and a wheel built
# without the folder leaves the package out (`kubetrain bench` then says it runs from a checkout).
OPTIONAL = {"kubetrain_bench"}
FOLDERS = {p: f for p, f in FOLDERS.items() if p not in OPTIONAL or (HERE / f).is_dir()}

packages = []
for package, folder in FOLDERS.items():
    packages.append(package)
    packages += [f"{package}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=FOLDERS)
