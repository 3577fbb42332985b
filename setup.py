"""Maps the design's folders (operator/, trainer/) onto import packages.

The folder `operator/` can never be imported under that name (the standard
library owns `operator`), so the packages are `kubetrain_operator` and
`kubetrain_trainer`. Everything else lives in pyproject.toml.
"""

from setuptools import find_packages, setup

# `kubetrain` is the small public API of users' own training scripts (import kubetrain).
FOLDERS = {"kubetrain_contract": "contract", "kubetrain_operator": "operator", "kubetrain_trainer": "trainer",
           "kubetrain": "kubetrain"}

packages = []
for package, folder in FOLDERS.items():
    packages.append(package)
    packages += [f"{package}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=FOLDERS)
