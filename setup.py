"""Package discovery (everything else is in pyproject.toml).

loaders/ and tools/ live at the top of the repository (the design card) but install only under the
shardkit namespace: no generic top-level `loaders` or `tools` package is ever installed. Each folder's
packages are found, not listed, so a new subpackage (say shardkit.train.parallel) is in the wheel
without an edit here.
"""

from setuptools import find_packages, setup

PACKAGE_DIR = {"shardkit": "shardkit", "shardkit.loaders": "loaders", "shardkit.tools": "tools"}


def discovered(package_dir: dict[str, str]) -> list[str]:
    """Every package under each mapped folder, named by the package the folder installs as."""
    packages = []
    for name, folder in package_dir.items():
        packages.append(name)
        packages += [f"{name}.{sub}" for sub in find_packages(folder)]
    return packages


setup(package_dir=PACKAGE_DIR, packages=discovered(PACKAGE_DIR))
