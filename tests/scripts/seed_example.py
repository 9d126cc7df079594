"""The Complete Example of the user's API reference (seed 004), imports adapted to this layout,
``@dataclass`` dropped, ``MyDataset`` made of random tensors and 2 epochs instead of 10."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import TrainingParameters
from dream_trainer.mixins import SetupConfigMixin, SetupMixin


def MyDataset(split: str) -> TensorDataset:
    generator = torch.Generator().manual_seed(0 if split == "train" else 1)
    return TensorDataset(torch.randn(512, 1, 28, 28, generator=generator),
                         torch.randint(0, 10, (512,), generator=generator))


class MyConfig(BaseTrainerConfig, SetupConfigMixin):
    learning_rate: float = 1e-3
    hidden_size: int = 128

class MyTrainer(BaseTrainer, SetupMixin):
    config: MyConfig
    
    def configure_models(self):
        """Create model on meta device"""
        self.model = nn.Sequential(
            nn.Linear(784, self.config.hidden_size),
            nn.ReLU(),
            nn.Linear(self.config.hidden_size, 10)
        )
    
    def init_weights(self):
        """Initialize weights after device placement"""
        def init_fn(m):
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        
        self.model.apply(init_fn)
    
    def configure_optimizers(self):
        """Set up optimizer"""
        self.optimizer = torch.optim.Adam(
            self.model.parameters(),
            lr=self.config.learning_rate
        )
    
    def configure_dataloaders(self):
        """Return train and validation dataloaders"""
        train_dataset = MyDataset("train")
        val_dataset = MyDataset("val")
        
        train_loader = DataLoader(
            train_dataset,
            batch_size=self.config.training_parameters.train_batch_size,
            shuffle=True
        )
        
        val_loader = DataLoader(
            val_dataset,
            batch_size=self.config.training_parameters.val_batch_size,
            shuffle=False
        )
        
        return train_loader, val_loader
    
    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x.view(x.size(0), -1))
        loss = F.cross_entropy(logits, y)
        
        self.backward(loss)
        
        if not self.is_accumulating_gradients:
            grad_norm = self.step(self.model, self.optimizer)
            accuracy = (logits.argmax(dim=1) == y).float().mean()
            
            return {
                "loss": loss,
                "accuracy": accuracy,
                "grad_norm": grad_norm
            }
        
        return {"loss": loss}
    
    def validation_step(self, batch, batch_idx):
        x, y = batch
        
        with torch.no_grad():
            logits = self.model(x.view(x.size(0), -1))
            loss = F.cross_entropy(logits, y)
            accuracy = (logits.argmax(dim=1) == y).float().mean()
        
        return {
            "val_loss": loss,
            "val_accuracy": accuracy
        }

# Usage
config = MyConfig(
    project="mnist-classification",
    group="baseline",
    experiment="run-001",
    training_parameters=TrainingParameters(
        n_epochs=2,
        train_batch_size=32,
        gradient_accumulation_steps=4
    )
)

trainer = MyTrainer(config)
trainer.fit()
print(f"rank={trainer.world.rank} epochs={trainer.current_epoch} steps={trainer.global_step} "
      f"batches={trainer.local_batches}")
