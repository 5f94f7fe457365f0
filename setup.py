"""The packages, and the checkout's ``configs/`` shipped as ``maxdiffusion_svg/configs`` (the
shipped configs stay at the repository's root, where the docs and tests name them; a wheel
carries them so that ``tiles wan_svg.yml`` finds them by name: ``plugin.overlay``)."""

from setuptools import find_namespace_packages, setup

setup(packages=[*find_namespace_packages(include=["maxdiffusion_svg*"]), "maxdiffusion_svg.configs"],
      package_dir={"maxdiffusion_svg.configs": "configs"},
      package_data={"maxdiffusion_svg.configs": ["*.yml"]})
