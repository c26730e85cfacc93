"""Install ``modelparallel-compat.pth`` next to the packages (site-packages), in wheels
and in editable installs: with ``MODELPARALLEL_COMPAT=sagemaker`` in the environment, it
makes SageMaker's imports resolve to modelparallel in any interpreter, whatever
launcher started it (see src/modelparallel_compat.py). Everything else is in
pyproject.toml.

setuptools has no public way to put a top-level file into an editable wheel: the
editable command below extends ``_run_build_commands``, a private method (setuptools is
pinned in pyproject.toml's build requirements, and tests/unit/test_repository.py fails
if the file is not installed).
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "modelparallel-compat.pth"
SOURCE = os.path.join("src", PTH)


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(SOURCE, os.path.join(self.build_lib, PTH))

    def get_outputs(self, *args, **kwargs):
        return [*super().get_outputs(*args, **kwargs), os.path.join(self.build_lib, PTH)]


class EditableWheelWithPth(editable_wheel):
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        shutil.copy(SOURCE, os.path.join(unpacked_wheel, PTH))
        return result


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
