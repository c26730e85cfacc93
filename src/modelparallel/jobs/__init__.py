"""Training jobs: SageMaker's estimator workflow on this machine or a cluster.

::

    from modelparallel.jobs import Estimator, TrainingInput

    est = Estimator("train.py", source_dir="src", instance_count=2, processes_per_host=2,
                    hyperparameters={"epochs": 3},
                    distribution={"modelparallel": {"hybrid_shard_degree": 2,
                                                    "tensor_parallel_degree": 2}})
    est.fit({"train": "data/train", "val": TrainingInput("data/val")})
    est.model_data   # .../JOB/output/model.tar.gz
"""

from modelparallel.jobs.channels import TrainingInput
from modelparallel.jobs.estimator import Estimator, JobFailed, TrainingJob
from modelparallel.jobs.spec import JobError, JobSpec

__all__ = ["Estimator", "JobError", "JobFailed", "JobSpec", "TrainingInput", "TrainingJob"]
